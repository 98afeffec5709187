"""Start methods (``specs/python.md``, "Start methods"): ``forkserver``
targets come from a fresh interpreter (no lock of a parent thread, no
parent memory), ``preload`` modules are imported there, ``fork`` warns
when other threads run, and the options pass through Executor and
NextLevel."""

import os
import re
import signal
import sys
import textwrap
import threading
import time
import warnings

import pytest

import callreg

HELPER = """
import threading

LOCK = threading.Lock()


def try_lock(timeout):
    # Whether this process's LOCK can be taken within timeout seconds.
    got = LOCK.acquire(timeout=timeout)
    if got:
        LOCK.release()
    return got
"""


def square(x):
    return x * x


def cube(x):
    return x * x * x


def parent_of(pid):
    with open("/proc/%d/stat" % pid) as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def callreg_shm():
    return sorted(name for name in os.listdir("/dev/shm") if "callreg" in name)


def wait_for_target(worker, target, phase, incarnation, timeout=20.0):
    deadline = time.monotonic() + timeout
    while worker.target_state(target) != (phase, incarnation):
        assert time.monotonic() < deadline, worker.target_events()
        time.sleep(0.005)


def write_module(tmp_path, monkeypatch, name, source):
    (tmp_path / (name + ".py")).write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))


def other_threads():
    """This process's Python threads but this one and callreg's own."""
    return [
        t for t in threading.enumerate() if t is not threading.current_thread() and not t.name.startswith("callreg-")
    ]


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_lock_a_parent_thread_holds_at_start_is_held_in_forked_targets_only(tmp_path, monkeypatch, start_method):
    write_module(tmp_path, monkeypatch, "fs_lock_helper", HELPER)
    import fs_lock_helper

    taken = threading.Event()
    release = threading.Event()

    def hold():
        with fs_lock_helper.LOCK:
            taken.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait()
    try:
        with callreg.Worker(2, start_method=start_method) as w:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                w.start()
            runtime_warnings = [c for c in caught if issubclass(c.category, RuntimeWarning)]
            h = w.register(fs_lock_helper.try_lock)
            started = time.monotonic()
            result = w.call_all(h, 2.0)
            elapsed = time.monotonic() - started
            if start_method == "forkserver":
                # A fresh interpreter imported the module: its lock is free.
                assert result == {0: True, 1: True}
                assert elapsed < 2.0
                assert runtime_warnings == []
            else:
                # The forked copy of the lock stays held forever.
                assert result == {0: False, 1: False}
                assert len(runtime_warnings) == 1
    finally:
        release.set()
        holder.join()
    del sys.modules["fs_lock_helper"]


def test_forkserver_serves_registers_calls_maps_and_replaces_a_killed_target():
    shm_before = callreg_shm()
    with callreg.Worker(2, start_method="forkserver") as w:
        before = w.register(square)
        w.start()
        after = w.register(cube)
        pids = [w.target_pid(t) for t in (0, 1)]
        template = parent_of(pids[0])
        assert template != os.getpid()
        assert parent_of(pids[1]) == template
        assert parent_of(template) == os.getpid()
        assert w.call_all(before, 3) == {0: 9, 1: 9}
        assert w.call(after, 2, target=1) == 8
        assert list(w.map(before, range(6))) == [0, 1, 4, 9, 16, 25]
        assert w.submit(after, 3).result() == 27
        os.kill(pids[1], signal.SIGKILL)
        wait_for_target(w, 1, "joined", 1)
        new = w.target_pid(1)
        assert new != pids[1]
        assert parent_of(new) == template
        assert w.call(before, 4, target=1) == 16
        assert w.call(after, 4, target=1) == 64
        assert w.targets == [0, 1]
    assert w.targets == []
    assert not os.path.exists("/proc/%d" % template) or parent_of(template) != os.getpid()
    assert callreg_shm() == shm_before


def test_a_forkserver_target_has_none_of_the_parents_state_but_its_initializer_runs():
    marker = "callreg-forkserver-%d" % os.getpid()
    os.environ["CALLREG_FS_TEST"] = marker
    try:
        # A closure, pickled into the template with cloudpickle.
        seen = []

        def init(value):
            os.environ["CALLREG_FS_INIT"] = value
            seen.append(value)

        with callreg.Worker(2, start_method="forkserver", initializer=init, initargs=("set",)) as w:
            w.start()
            probe = w.register(
                lambda: (
                    os.environ.get("CALLREG_FS_TEST"),
                    os.environ.get("CALLREG_FS_INIT"),
                    "callreg._worker" in sys.modules,
                    os.getcwd(),
                )
            )
            results = w.call_all(probe)
    finally:
        del os.environ["CALLREG_FS_TEST"]
    # The environment and working directory are the parent's; the
    # initializer ran in each target, not here.
    assert results == {t: (marker, "set", True, os.getcwd()) for t in (0, 1)}
    assert seen == []


def test_a_preload_module_is_imported_in_every_target(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "fs_preloaded", "VALUE = 7\n")
    assert "fs_preloaded" not in sys.modules

    def loaded():
        return "fs_preloaded" in sys.modules

    with callreg.Worker(2, start_method="forkserver", preload=["fs_preloaded"]) as w:
        w.start()
        assert w.call_all(w.register(loaded)) == {0: True, 1: True}
    with callreg.Worker(1, start_method="forkserver") as w:
        w.start()
        assert w.call_all(w.register(loaded)) == {0: False}
    assert "fs_preloaded" not in sys.modules


def test_a_preload_module_that_fails_to_import_fails_the_start_naming_it(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "fs_broken", "1 / 0\n")
    for name, why in (
        ("fs_no_such_module", "ModuleNotFoundError: No module named 'fs_no_such_module'"),
        ("fs_broken", "ZeroDivisionError: division by zero"),
    ):
        with callreg.Worker(2, start_method="forkserver", preload=["os", name]) as w:
            started = time.monotonic()
            with pytest.raises(callreg.CallregError) as raised:
                w.start()
            assert time.monotonic() - started < 10
            assert raised.value.code == "IO_FAILED"
            assert str(raised.value) == (
                "IO_FAILED: the template process did not start: preload module %r failed to import: %s "
                "(operation start)" % (name, why)
            )
            assert w.targets == []


def test_a_preload_module_that_exits_or_hangs_is_named_in_the_start_error(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "fs_exits", "import os\nos._exit(3)\n")
    write_module(tmp_path, monkeypatch, "fs_hangs", "import time\ntime.sleep(60)\n")
    with callreg.Worker(1, start_method="forkserver", preload=["fs_exits"]) as w:
        with pytest.raises(callreg.CallregError) as raised:
            w.start()
    assert str(raised.value) == (
        "IO_FAILED: the template process did not start: it exited with status 3 before it was ready "
        "(it imports the preload modules ['fs_exits'] first) (operation start)"
    )
    with callreg.Worker(1, start_method="forkserver", preload=["fs_hangs"], control_timeout=1) as w:
        started = time.monotonic()
        with pytest.raises(callreg.CallregError) as raised:
            w.start()
        assert time.monotonic() - started < 10
    assert re.fullmatch(
        r"IO_FAILED: the template process did not start: it was not ready after [0-9.]+m?s "
        r"\(it imports the preload modules \['fs_hangs'\] first: one of them may hang\) \(operation start\)",
        str(raised.value),
    ), str(raised.value)


def test_start_under_fork_warns_once_with_another_thread_and_not_without():
    assert other_threads() == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with callreg.Worker(1) as w:
            w.start()
    assert [c for c in caught if issubclass(c.category, RuntimeWarning)] == []
    # A live Worker's own dispatcher thread is no reason to warn.
    with callreg.Worker(1) as first:
        first.start()
        h = first.register(square)
        # A done-callback has the dispatcher thread resolve the future.
        done = threading.Event()
        first.submit(h, 3).add_done_callback(lambda f: done.set())
        assert done.wait(10)
        assert first._dispatch.thread is not None and first._dispatch.thread.is_alive()
        assert threading.active_count() == 2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with callreg.Worker(1) as w:
                w.start()
        assert [c for c in caught if issubclass(c.category, RuntimeWarning)] == []
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        with pytest.warns(RuntimeWarning, match='runs 1 other threads.*start_method="forkserver"') as caught:
            with callreg.Worker(1) as w:
                w.start()
        assert len([c for c in caught if issubclass(c.category, RuntimeWarning)]) == 1
        assert caught[0].filename == __file__
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with callreg.Worker(1, start_method="forkserver") as w:
                w.start()
        assert [c for c in caught if issubclass(c.category, RuntimeWarning)] == []
    finally:
        stop.set()
        thread.join()


def test_start_method_and_preload_are_checked():
    with pytest.raises(ValueError, match="start_method must be 'fork' or 'forkserver', not 'spawn'"):
        callreg.Worker(1, start_method="spawn")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="preload needs start_method='forkserver'"):
        callreg.Worker(1, preload=["os"])
    with pytest.raises(TypeError, match="not a str"):
        callreg.Worker(1, start_method="forkserver", preload="os")
    with pytest.raises(TypeError, match="module names"):
        callreg.Worker(1, start_method="forkserver", preload=[3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="start_method must be"):
        callreg.Executor(1, start_method="spawn")  # type: ignore[typeddict-item]
    with pytest.raises(ValueError, match="start_method must be"):
        callreg.NextLevel(1, start_method="thread")  # type: ignore[arg-type]


def test_an_executor_passes_the_start_method_and_preload_on(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "fs_exec_preloaded", "")
    with callreg.Executor(2, start_method="forkserver", preload=["fs_exec_preloaded"]) as ex:
        pids = ex.worker.targets and [ex.worker.target_pid(t) for t in (0, 1)]
        assert all(parent_of(pid) != os.getpid() for pid in pids)
        assert ex.submit(square, 5).result() == 25
        assert list(ex.map(cube, [1, 2, 3])) == [1, 8, 27]
        assert ex.submit(lambda: "fs_exec_preloaded" in sys.modules).result() is True


def inner_start(ctx):
    """The inner Worker's start method and whether its targets are this
    next-level child's grandchildren (forked by its template)."""
    pids = [ctx.inner.target_pid(t) for t in ctx.inner.targets]
    return ctx.inner._start_method, [parent_of(pid) != os.getpid() for pid in pids]


def test_a_next_level_inner_worker_takes_its_start_method(tmp_path, monkeypatch):
    level = callreg.NextLevel(2, start_method="forkserver", preload=("os",))
    assert (level.start_method, level.preload) == ("forkserver", ("os",))
    with callreg.Worker(0, next_level=level, next_level_targets=1) as w:
        w.start()
        assert w.call(w.register(inner_start), target=0) == ("forkserver", [True, True])
