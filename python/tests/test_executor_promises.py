"""The promises ProcessPoolExecutor keeps, kept by callreg.Executor: no
lost work, the task's own exception, callables by identity, futures
delivered once, errors where and as that pool raises them
(``specs/python.md`` §3a)."""

import concurrent.futures
import dataclasses
import gc
import multiprocessing
import os
import pickle
import sys
import threading
import time
import weakref
from concurrent.futures.process import BrokenProcessPool

import pytest
from conftest import outputs_of

import callreg

# A program that leaves work it keeps no future of, by every way a
# program ends: the `with` block, shutdown(wait=True), shutdown(wait=False)
# then interpreter exit, interpreter exit alone, and an Executor nothing
# holds. Each task writes a marker file after a pause; the parent lists
# them once the program ended.
FIRE_AND_FORGET_PROGRAM = """
import concurrent.futures, multiprocessing, os, sys, time
import callreg

def save(directory, name):
    time.sleep(0.2)
    open(os.path.join(directory, name), "w").close()

def executor(n):
    if sys.argv[1] == "ppe":
        return concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"))
    return callreg.Executor(n)

directory = sys.argv[2]
with executor(2) as ex:
    for i in range(4):
        ex.submit(save, directory, "with-submit-%d" % i)
    ex.map(save, [directory] * 3, ["with-map-%d" % i for i in range(3)])
ex = executor(2)
ex.submit(save, directory, "shutdown-wait")
ex.shutdown(wait=True)
ex = executor(2)
ex.submit(save, directory, "shutdown-nowait")
ex.shutdown(wait=False)
executor(1).submit(save, directory, "unheld")
kept = executor(2)
for i in range(3):
    kept.submit(save, directory, "at-exit-%d" % i)
kept.map(save, [directory], ["at-exit-map"])
"""

EXPECTED_MARKERS = sorted(
    ["with-submit-%d" % i for i in range(4)]
    + ["with-map-%d" % i for i in range(3)]
    + ["shutdown-wait", "shutdown-nowait", "unheld"]
    + ["at-exit-%d" % i for i in range(3)]
    + ["at-exit-map"]
)


def test_work_without_a_future_runs_to_its_end_however_the_program_ends(tmp_path):
    import subprocess

    for kind in ("ppe", "callreg"):
        directory = tmp_path / kind
        directory.mkdir()
        done = subprocess.run(
            [sys.executable, "-c", FIRE_AND_FORGET_PROGRAM, kind, str(directory)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert sorted(os.listdir(directory)) == EXPECTED_MARKERS, kind


class Coded(Exception):
    """An exception with a ``code`` attribute and an ``__init__`` whose
    arguments are not its ``args``."""

    def __init__(self, code, detail):
        super().__init__("bad: %s" % detail)
        self.code = code
        self.detail = detail


def raise_coded(code):
    raise Coded(code, "detail %d" % code)


def raise_runtime_error():
    raise RuntimeError("plain")


def test_the_task_s_exception_is_itself():
    with callreg.Executor(1) as ex:
        error = ex.submit(raise_coded, 7).exception(timeout=10)
        assert type(error) is Coded
        assert (error.code, error.detail, error.args, str(error)) == (
            7,
            "detail 7",
            ("bad: detail 7",),
            "bad: detail 7",
        )
        cause = error.__cause__
        assert type(cause) is callreg.RemoteTraceback
        assert cause.remote_type == "test_executor_promises.Coded"
        assert cause.target == 0
        assert 'in raise_coded\n    raise Coded(code, "detail %d" % code)\n' in cause.text
        assert cause.text.endswith("test_executor_promises.Coded: bad: detail 7\n")
        with pytest.raises(Coded) as raised:
            ex.submit(raise_coded, 8).result()
        assert raised.value.code == 8
        error = ex.submit(raise_runtime_error).exception(timeout=10)
        assert type(error) is RuntimeError and error.args == ("plain",)
        # Not a TaskError: except TaskError catches only what cannot be
        # raised as itself.
        assert not isinstance(error, callreg.TaskError)
        # It pickles as itself, for a program that sends it on.
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is RuntimeError and again.args == ("plain",)


def test_a_result_that_does_not_pickle_raises_the_pickling_error():
    with callreg.Executor(1) as ex:
        error = ex.submit(threading.Lock).exception(timeout=10)
        assert type(error) is TypeError
        assert str(error) == "cannot pickle '_thread.lock' object"
        if sys.version_info >= (3, 11):
            assert error.__notes__[0] == "(raised pickling the task's result, of type '_thread.lock', in its target)"
        assert ex.submit(abs, -2).result(timeout=10) == 2


def test_an_argument_that_does_not_pickle_fails_its_future_not_submit():
    with callreg.Executor(1) as ex:
        future = ex.submit(abs, threading.Lock())
        with pytest.raises(TypeError, match=r"^cannot pickle '_thread.lock' object$"):
            future.result(timeout=10)
        results = ex.map(abs, [-1, threading.Lock(), -3])
        assert next(results) == 1
        with pytest.raises(TypeError, match=r"^cannot pickle '_thread.lock' object$"):
            next(results)


class ExitsWhenUnpickled:
    def __reduce__(self):
        return (sys.exit, (3,))


def test_a_result_that_exits_when_unpickled_never_ends_this_process():
    with callreg.Executor(1) as ex:
        with pytest.raises(BrokenProcessPool) as raised:
            ex.submit(ExitsWhenUnpickled).result(timeout=10)
        assert type(raised.value) is callreg.ResultError
        assert (raised.value.code, raised.value.operation) == ("DESERIALIZE_FAILED", "result")
        assert str(raised.value) == (
            "the task returned, but its result could not be unpickled in this process: SystemExit: 3"
        )
        assert type(raised.value.__cause__) is SystemExit
        # Through the dispatcher thread too (an armed future).
        future = ex.submit(ExitsWhenUnpickled)
        concurrent.futures.wait([future], timeout=10)
        assert type(future.exception()) is callreg.ResultError
        assert ex.submit(abs, -5).result(timeout=10) == 5


class RefusesToUnpickle:
    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise ValueError("not here")


class ExitsWhenUnpickledInTarget:
    def __reduce__(self):
        return (_exit_in_target, ())


def _exit_in_target():
    if multiprocessing.parent_process() is None and os.getpid() == _PARENT:
        return ExitsWhenUnpickledInTarget.__new__(ExitsWhenUnpickledInTarget)
    sys.exit(1)


_PARENT = os.getpid()


def test_an_argument_that_does_not_unpickle_in_the_target_fails_its_task_only():
    with callreg.Executor(1) as ex:
        for argument, raised in ((RefusesToUnpickle(), "ValueError: not here"), (ExitsWhenUnpickledInTarget(), "1")):
            error = ex.submit(id, argument).exception(timeout=10)
            assert type(error) is callreg.TaskInputError
            assert isinstance(error, BrokenProcessPool) and isinstance(error, callreg.TaskError)
            assert error.remote_type == "TaskInputInvalid"
            assert raised in str(error), str(error)
        assert ex.submit(abs, -6).result(timeout=10) == 6


def exit_task(code):
    sys.exit(code)


def test_a_task_s_system_exit_is_raised_as_itself():
    with callreg.Executor(1) as ex:
        with pytest.raises(SystemExit) as raised:
            ex.submit(exit_task, 4).result(timeout=10)
        assert type(raised.value) is SystemExit and raised.value.code == 4
        assert type(raised.value.__cause__) is callreg.RemoteTraceback
        assert ex.submit(abs, -7).result(timeout=10) == 7


@dataclasses.dataclass(frozen=True)
class Scale:
    name: str
    factor: int = dataclasses.field(compare=False)

    def __call__(self, x):
        return x * self.factor


def test_callables_that_compare_equal_each_run_as_themselves():
    with callreg.Executor(1) as ex:
        assert Scale("s", 2) == Scale("s", 3)
        assert ex.submit(Scale("s", 2), 10).result(timeout=10) == 20
        assert ex.submit(Scale("s", 3), 10).result(timeout=10) == 30
        assert list(ex.map(Scale("s", 4), [1, 2])) == [4, 8]


class Holder:
    def __init__(self, base):
        self.base = base

    def add(self, x):
        return self.base + x


def test_the_cache_keeps_no_callable_or_bound_object_alive():
    with callreg.Executor(1) as ex:
        holder = Holder(5)
        assert ex.submit(holder.add, 1).result(timeout=10) == 6
        assert ex.submit(holder.add, 2).result(timeout=10) == 7
        held = weakref.ref(holder)
        del holder
        gc.collect()
        assert held() is None

        def local(x):
            return x + 1

        assert ex.submit(local, 1).result(timeout=10) == 2
        function = weakref.ref(local)
        del local
        gc.collect()
        assert function() is None


class Big:
    pass


def make_big(i):
    return Big()


def test_map_releases_each_result_once_yielded():
    with callreg.Executor(1) as ex:
        for chunksize in (1, 2):
            results = ex.map(make_big, range(4), chunksize=chunksize)
            first = next(results)
            seen = weakref.ref(first)
            del first
            gc.collect()
            assert seen() is None, chunksize
            assert [type(r) for r in results] == [Big] * 3


def square(x):
    return x * x


def test_as_completed_and_wait_see_each_future_once_under_callbacks_from_threads():
    # A future resolved by a waiter in one thread (inline, with no
    # condition made yet) races with as_completed or wait installing its
    # waiter from another, and with done-callbacks added from a third.
    # 10,000 rounds of 4 futures: each future is delivered once (as_completed raised
    # KeyError, a future delivered twice, when the state was written
    # before the condition was taken), every callback runs once.
    rounds = 10_000
    with callreg.Executor(2) as ex:
        calls = []
        failures = []

        def wait_inline(futures):
            for future in futures:
                future.result(timeout=30)

        def add_callbacks(futures):
            for future in futures:
                future.add_done_callback(calls.append)

        for i in range(rounds):
            futures = [ex.submit(square, j) for j in range(4 * i, 4 * i + 4)]
            helpers = [
                threading.Thread(target=wait_inline, args=(futures,)),
                threading.Thread(target=add_callbacks, args=(futures[::-1],)),
            ]
            for helper in helpers:
                helper.start()
            try:
                if i % 2:
                    got = sorted(f.result() for f in concurrent.futures.as_completed(futures, timeout=30))
                    if got != sorted(j * j for j in range(4 * i, 4 * i + 4)):
                        failures.append((i, got))
                else:
                    done, not_done = concurrent.futures.wait(futures, timeout=30)
                    if not_done or len(done) != 4 or not all(f.done() for f in done):
                        failures.append((i, "wait", len(done), len(not_done)))
            except Exception as error:  # KeyError from as_completed: a future delivered twice
                failures.append((i, repr(error)))
            for helper in helpers:
                helper.join()
        deadline = time.monotonic() + 30
        while len(calls) < 4 * rounds and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failures == []
        assert len(calls) == 4 * rounds
        assert len({id(f) for f in calls}) == 4 * rounds


def lose_target():
    os._exit(9)


def test_a_lost_target_is_a_broken_process_pool_and_the_pool_stays_usable():
    with callreg.Executor(1) as ex:
        with pytest.raises(BrokenProcessPool) as raised:
            ex.submit(lose_target).result(timeout=30)
        assert isinstance(raised.value, callreg.TargetLostError)
        assert raised.value.code == "TARGET_LOST"
        deadline = time.monotonic() + 30
        while True:
            try:
                assert ex.submit(abs, -3).result(timeout=30) == 3
                break
            except callreg.TargetLostError:  # NO_LIVE_TARGET until the replacement serves
                assert time.monotonic() < deadline
                time.sleep(0.05)


def test_max_tasks_per_child_replaces_a_target_after_its_tasks():
    with callreg.Executor(1, max_tasks_per_child=3) as ex:
        pids = [ex.submit(os.getpid).result(timeout=30) for _ in range(7)]
        assert pids[0] == pids[1] == pids[2] != pids[3] == pids[4] == pids[5] != pids[6]
        assert len(set(pids)) == 3
        ends = [
            (e["event"], e["incarnation"], e.get("tasks"))
            for e in ex.worker.target_events()
            if e["event"] in ("retired", "lost")
        ]
        assert ends == [("retired", 0, 3), ("retired", 1, 3)]
    # Every task at once, on a bound of one each: those no target can
    # take wait for a replacement, and every one runs.
    with callreg.Executor(3, max_tasks_per_child=1) as ex:
        futures = [ex.submit(pow, i, 2) for i in range(12)]
        assert [f.result(timeout=60) for f in futures] == [i * i for i in range(12)]
        assert len({f.result() for f in futures}) == 12


def test_a_task_waiting_for_a_replacement_is_cancelled_at_once():
    with callreg.Executor(1, max_tasks_per_child=1) as ex:
        running = ex.submit(time.sleep, 0.5)
        waiting = ex.submit(abs, -1)
        assert waiting.cancel()
        assert waiting.cancelled()
        assert running.result(timeout=30) is None
        assert ex.submit(abs, -2).result(timeout=30) == 2


def test_max_tasks_per_child_is_checked_as_process_pool_executor_checks_it():
    with pytest.raises(ValueError, match=r"^max_tasks_per_child must be >= 1$"):
        callreg.Executor(1, max_tasks_per_child=0)
    with pytest.raises(TypeError, match=r"^max_tasks_per_child must be an integer$"):
        callreg.Executor(1, max_tasks_per_child="3")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"^max_tasks_per_target \(2\) needs replacement targets: a respawn_limit above 0$",
    ):
        callreg.Executor(1, max_tasks_per_child=2, respawn_limit=0)
    with pytest.raises(
        ValueError,
        match=r"^Executor's max_tasks_per_child \(2\) and max_tasks_per_target=3 disagree: give one of them$",
    ):
        callreg.Executor(1, max_tasks_per_child=2, max_tasks_per_target=3)


def test_mp_context_names_the_start_method():
    for context, method in (
        (multiprocessing.get_context("fork"), "fork"),
        ("fork", "fork"),
        (multiprocessing.get_context("forkserver"), "forkserver"),
        (multiprocessing.get_context("spawn"), "forkserver"),
    ):
        with callreg.Executor(1, mp_context=context) as ex:
            assert ex.worker._start_method == method
            assert ex.submit(abs, -1).result(timeout=30) == 1


def mark_then_sleep(path, seconds):
    open(path, "w").close()
    time.sleep(seconds)


def test_kill_workers_and_terminate_workers_stop_running_tasks(tmp_path):
    for i, stop in enumerate(
        (
            lambda ex: ex.shutdown(kill_workers=True),
            lambda ex: ex.terminate_workers(),
            lambda ex: ex.kill_workers(),
        )
    ):
        ex = callreg.Executor(1)
        marker = tmp_path / str(i)
        running = ex.submit(mark_then_sleep, str(marker), 60)
        queued = ex.submit(time.sleep, 60)
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        began = time.monotonic()
        stop(ex)
        assert time.monotonic() - began < 10
        assert queued.cancelled()
        with pytest.raises(callreg.LifecycleError, match="the Worker closed before the task's result arrived"):
            running.result(timeout=10)
        with pytest.raises(RuntimeError, match="cannot schedule new futures after shutdown"):
            ex.submit(abs, 1)


PPE_EXCEPTION_PROGRAM = """
import concurrent.futures, multiprocessing, sys
import callreg

class Coded(Exception):
    def __init__(self, code):
        super().__init__(code)
        self.code = code

def fail(code):
    raise Coded(code)

if sys.argv[1] == "ppe":
    ex = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
else:
    ex = callreg.Executor(1)
with ex:
    error = ex.submit(fail, 7).exception()
    print(type(error).__name__, error.code, error.args, type(error.__cause__).__name__)
"""


def test_a_task_exception_reads_as_under_process_pool_executor():
    outputs = outputs_of(PPE_EXCEPTION_PROGRAM)
    assert outputs["ppe"] == "Coded 7 (7,) _RemoteTraceback\n"
    assert outputs["callreg"] == "Coded 7 (7,) RemoteTraceback\n"


def put(queue, value):
    queue.put(value)
    return value


_INIT_QUEUE = None


def remember_queue(queue):
    global _INIT_QUEUE
    _INIT_QUEUE = queue


def put_from_initializer(value):
    _INIT_QUEUE.put(value)
    return value


def test_manager_proxies_reach_forkserver_targets():
    # A Manager's proxy connects to its manager with this process's
    # authentication key: the template and its targets hold it too.
    with multiprocessing.Manager() as manager:
        queue = manager.Queue()
        with callreg.Executor(1, mp_context="forkserver") as ex:
            assert ex.submit(put, queue, 5).result(timeout=60) == 5
        assert queue.get(timeout=10) == 5
        init_queue = manager.Queue()
        with callreg.Executor(1, mp_context="spawn", initializer=remember_queue, initargs=(init_queue,)) as ex:
            assert ex.submit(put_from_initializer, 6).result(timeout=60) == 6
        assert init_queue.get(timeout=10) == 6


def test_an_inherit_only_multiprocessing_object_in_initargs_names_the_fix():
    # Under fork the targets inherit it.
    queue = multiprocessing.get_context("fork").Queue()
    with callreg.Executor(1, initializer=remember_queue, initargs=(queue,)) as ex:
        assert ex.submit(put_from_initializer, 7).result(timeout=30) == 7
    assert queue.get(timeout=10) == 7
    queue.close()
    queue.join_thread()
    # Under forkserver it cannot travel: the error says what to use. (A
    # Queue of the fork context: another context's would start
    # multiprocessing's resource tracker, a process that outlives the
    # test.)
    queue = multiprocessing.get_context("fork").Queue()
    with pytest.raises(RuntimeError, match=r"pass a multiprocessing.Manager\(\) proxy instead") as raised:
        callreg.Executor(1, mp_context="forkserver", initializer=remember_queue, initargs=(queue,))
    assert "should only be shared between processes through inheritance" in str(raised.value)
    queue.close()
    queue.join_thread()


def put_many(count):
    for i in range(count):
        _INIT_QUEUE.put(b"x" * 100 + str(i).encode())
    return count


def test_what_a_task_puts_in_a_queue_is_flushed_before_its_target_exits():
    # A Queue used here before the fork (its feeder thread runs here, not
    # in a target): a target runs multiprocessing's after-fork hooks, and
    # at its end its finalizers, which flush the feeder, as a child of
    # multiprocessing's own does. (What it put fits in the pipe: nothing
    # reads it here until the Executor closed, and a feeder blocked on a
    # full pipe would be joined for ever, here as under
    # ProcessPoolExecutor; the close's grace bounds that.)
    queue = multiprocessing.get_context("fork").Queue()
    queue.put(b"here")
    assert queue.get(timeout=10) == b"here"
    with multiprocessing.Manager() as manager:
        shared = manager.dict()
        # The Queue's feeder thread runs here: the fork warns of it.
        with pytest.warns(
            RuntimeWarning, match=r"^callreg.Worker.start\(\) forks its targets while this process runs 1 "
        ):
            ex = callreg.Executor(1, initializer=remember_queue, initargs=(queue,))
        with ex:
            assert ex.submit(put_many, 200).result(timeout=30) == 200
        got = [queue.get(timeout=10) for _ in range(200)]
        assert got == [b"x" * 100 + str(i).encode() for i in range(200)]
        # The targets ran no finalizer of this process's: its Manager
        # still serves.
        shared["k"] = 1
        assert dict(shared) == {"k": 1}
    queue.close()
    queue.join_thread()
