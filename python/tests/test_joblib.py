"""callreg.joblib: joblib.Parallel on callreg targets."""

import os

import pytest

joblib = pytest.importorskip("joblib")

import callreg.joblib  # noqa: E402  (registers the backend)


def square_and_pid(x):
    return x * x, os.getpid()


def test_parallel_runs_its_batches_in_targets():
    with joblib.parallel_config(backend="callreg", n_jobs=2):
        out = joblib.Parallel()(joblib.delayed(square_and_pid)(i) for i in range(20))
    assert [value for value, _ in out] == [i * i for i in range(20)]
    pids = {pid for _, pid in out}
    assert os.getpid() not in pids
    assert 1 <= len(pids) <= 2


def test_closures_travel_and_a_task_exception_is_itself():
    offset = 7
    assert joblib.Parallel(n_jobs=2, backend="callreg")(joblib.delayed(lambda x: x + offset)(i) for i in range(5)) == [
        7,
        8,
        9,
        10,
        11,
    ]
    with pytest.raises(ZeroDivisionError) as raised:
        joblib.Parallel(n_jobs=2, backend="callreg")(joblib.delayed(lambda x: 1 / x)(i) for i in range(-2, 3))
    assert type(raised.value) is ZeroDivisionError


def test_a_generator_and_one_job():
    results = joblib.Parallel(n_jobs=2, backend="callreg", return_as="generator")(
        joblib.delayed(abs)(-i) for i in range(6)
    )
    assert list(results) == [0, 1, 2, 3, 4, 5]
    # One job runs here (joblib's sequential backend): no target at all.
    assert (
        joblib.Parallel(n_jobs=1, backend="callreg")(joblib.delayed(os.getpid)() for _ in range(2)) == [os.getpid()] * 2
    )


def test_executor_options_go_to_the_executor():
    with joblib.parallel_config(backend="callreg", n_jobs=2, mp_context="forkserver"):
        out = joblib.Parallel()(joblib.delayed(square_and_pid)(i) for i in range(4))
    assert [value for value, _ in out] == [0, 1, 4, 9]
    with pytest.raises(TypeError, match=r"^Executor got an unexpected keyword argument 'bogus'"):
        with joblib.parallel_config(backend="callreg", n_jobs=2, bogus=1):
            joblib.Parallel()(joblib.delayed(abs)(i) for i in range(2))


def test_n_jobs_counts_as_joblib_counts():
    backend = callreg.joblib.CallregBackend()
    cpus = os.cpu_count() or 1
    assert [backend.effective_n_jobs(n) for n in (None, 1, 3, -1, -2)] == [1, 1, 3, cpus, max(cpus - 1, 1)]
    with pytest.raises(ValueError, match=r"^n_jobs == 0 in Parallel has no meaning$"):
        backend.effective_n_jobs(0)
