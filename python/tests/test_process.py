"""The process model: registration failures, lost targets, concurrency,
close, Ctrl-C, garbage collection and interpreter exit, fork hooks."""

import contextlib
import gc
import os
import pickle
import re
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import cloudpickle
import pytest
from conftest import nap, staged_left

import callreg

FORKED_CHILD = []


def _mark_child():
    FORKED_CHILD.append(os.getpid())


os.register_at_fork(after_in_child=_mark_child)


def fork_marks():
    return list(FORKED_CHILD)


def _explode(message):
    raise ValueError(message)


class Bomb:
    """Unpickles by raising ValueError."""

    def __reduce__(self):
        return (_explode, ("this payload refuses to load",))


def _square_after(seconds):
    time.sleep(seconds)
    return square


class SlowToLoad:
    """Unpickles into :func:`square` after sleeping ``seconds``."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __reduce__(self):
        return (_square_after, (self.seconds,))


def test_a_slow_unpickle_outlives_the_control_timeout_but_not_the_operation_timeout():
    slow = callreg._callreg.encode_envelope(pickle.dumps(SlowToLoad(1.5)))
    # Busy, not silent: the targets report the register alive meanwhile.
    # (Replacements off: what is checked is which targets are fenced.)
    with callreg.Worker(2, control_timeout=0.5, respawn_limit=0) as w:
        w.start()
        h = w.register_envelope(slow)
        assert w.call_all(h, 3) == {0: 9, 1: 9}
        assert w.targets == [0, 1]
    # The operation timeout bounds it all the same. Tried on one target
    # first (probe_first), it costs that target and is refused from then on.
    with callreg.Worker(2, control_timeout=0.5, operation_timeout=0.9, respawn_limit=0) as w:
        w.start()
        started = time.monotonic()
        with pytest.raises(callreg.RegisterError) as info:
            w.register_envelope(slow)
        elapsed = time.monotonic() - started
        assert 0.9 <= elapsed < 1.4, elapsed
        assert info.value.code == "REGISTER_POISONED"
        assert info.value.target == 0
        assert "fenced" in str(info.value)
        assert info.value.outcomes == {
            0: "fenced (it did not answer before the operation's bound and was fenced; it was killed by signal 9)"
        }
        assert w.targets == [1]
    # Sent to every target at once, it is fenced on each.
    with callreg.Worker(2, control_timeout=0.5, operation_timeout=0.9, probe_first=False, respawn_limit=0) as w:
        w.start()
        started = time.monotonic()
        with pytest.raises(callreg.RegisterError) as info:
            w.register_envelope(slow)
        elapsed = time.monotonic() - started
        assert 0.9 <= elapsed < 1.4, elapsed
        assert info.value.code == "REGISTER_PARTIAL_FAILURE"
        assert info.value.outcomes == {
            0: "fenced (it did not answer before the operation's bound and was fenced; it was killed by signal 9)",
            1: "fenced (it did not answer before the operation's bound and was fenced; it was killed by signal 9)",
        }
        assert w.targets == []


@contextlib.contextmanager
def _ctrl_c_handled():
    """Python's Ctrl-C handler for the block, whatever the process started
    with: Python keeps SIGINT ignored when it started ignored (a shell's
    ``trap '' INT``, a background job, as CI may run)."""
    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_a_register_raises_at_once_and_leaves_nothing_installed():
    with _ctrl_c_handled():
        _interrupt_a_register()


def _interrupt_a_register():
    slow = callreg._callreg.encode_envelope(pickle.dumps(SlowToLoad(1.0)))
    with callreg.Worker(2) as w:
        w.start()
        kept = w.register(square)
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
        started = time.monotonic()
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                w.register_envelope(slow)
            # At the next signal check, not once the register completed
            # (about 1 s on the probe, then 1 s on the other target).
            assert time.monotonic() - started < 0.8
        finally:
            timer.cancel()
        # The register goes on; the registration it made is released
        # once it completes: no handle nobody holds, nothing installed.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = w.inspect()
            if len(state["registry"]["handles"]) == 1 and all(
                len(t["installed"]) == 1 for t in state["targets"].values()
            ):
                break
            time.sleep(0.05)
        state = w.inspect()
        assert [h["hashid"] for h in state["registry"]["handles"]] == [kept.hashid]
        assert {t: [i["hashid"] for i in v["installed"]] for t, v in state["targets"].items()} == {
            0: [kept.hashid],
            1: [kept.hashid],
        }
        # Registered again, it installs afresh and serves.
        h = w.register_envelope(slow)
        assert w.call_all(h, 4) == {0: 16, 1: 16}


def _hold_gil(seconds, marker):
    """Creates ``marker``, then holds the GIL for ``seconds`` in one C call
    (a ``ctypes.PyDLL`` function keeps the GIL while it runs)."""
    import ctypes

    open(marker, "w").close()
    started = time.monotonic()
    ctypes.PyDLL(None).sleep(seconds)
    return time.monotonic() - started


def test_a_register_queued_behind_a_task_holding_the_gil_past_the_operation_timeout_is_not_poisoned(tmp_path):
    # The probe target runs a task that holds the GIL past the bound: the
    # register waits for the lock there, reported queued, and is fenced at
    # the bound without poisoning the callable (specs/protocol.md §2.8).
    marker = str(tmp_path / "holding")
    with callreg.Worker(2, control_timeout=1, operation_timeout=2.5, respawn_limit=0) as w:
        hold = w.register(_hold_gil)
        w.start()
        task = w.submit(hold, 8, marker, target=0)
        deadline = time.monotonic() + 20
        while not os.path.exists(marker):
            assert time.monotonic() < deadline, "the task never ran"
            time.sleep(0.005)
        time.sleep(0.05)
        fresh = lambda x: x * 3  # noqa: E731 - a callable no target has seen
        started = time.monotonic()
        with pytest.raises(callreg.RegisterError) as info:
            w.register(fresh)
        elapsed = time.monotonic() - started
        assert info.value.code == "REGISTER_PARTIAL_FAILURE", str(info.value)
        assert info.value.outcomes == {
            0: "fenced (it did not answer before the operation's bound and was fenced; it was killed by signal 9)"
        }
        assert 2.4 <= elapsed < 7, elapsed
        with pytest.raises(callreg.TargetLostError):
            task.result()
        assert w.targets == [1]
        # Not poisoned: nothing to forgive, and it registers on target 1.
        assert info.value.hashid == callreg.hashid(fresh)
        assert w.forgive(info.value.hashid) is False
        h = w.register(fresh)
        assert w.call(h, 5, target=1) == 15


def test_operation_timeout_is_checked():
    with pytest.raises(ValueError, match="operation_timeout must be positive"):
        callreg.Worker(1, operation_timeout=0)
    with pytest.raises(ValueError, match="operation_timeout must be positive"):
        callreg.Worker(1, operation_timeout=float("inf"))
    with pytest.raises(TypeError, match="operation_timeout must be a number of seconds"):
        callreg.Worker(1, operation_timeout="10")
    with pytest.raises(ValueError, match="operation_timeout must be positive"):
        callreg.NextLevel(1, operation_timeout=-1)
    assert callreg.NextLevel(1, control_timeout=2, operation_timeout=2.5).operation_timeout == 2.5
    # As the inner Worker's builder does, at once: not at least the control timeout.
    with pytest.raises(
        ValueError, match=r"^the operation timeout \(2.5 s\) must be at least the control timeout \(30 s\)$"
    ):
        callreg.NextLevel(1, operation_timeout=2.5)
    assert callreg.NextLevel(1).operation_timeout is None


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def square(x):
    return x * x


def test_a_payload_failing_to_unpickle_is_rolled_back_and_the_worker_stays_usable():
    # Every target gets each register at once (probe_first off).
    with callreg.Worker(3, probe_first=False) as w:
        w.start()
        good = w.register(square)
        envelope = callreg._callreg.encode_envelope(pickle.dumps(Bomb()))
        with pytest.raises(callreg.RegisterError) as info:
            w.register_envelope(envelope)
        error = info.value
        assert error.code == "REGISTER_PARTIAL_FAILURE"
        assert error.operation == "register"
        assert error.hashid == callreg.hashid(envelope)
        assert sorted(error.outcomes) == [0, 1, 2]
        for outcome in error.outcomes.values():
            assert outcome.startswith("failed (DESERIALIZE_FAILED: ")
            assert "this payload refuses to load" in outcome
        not_callable = callreg._callreg.encode_envelope(pickle.dumps(42))
        with pytest.raises(callreg.RegisterError) as info:
            w.register_envelope(not_callable)
        assert sorted(info.value.outcomes) == [0, 1, 2]
        assert all("not callable" in o for o in info.value.outcomes.values())
        assert w.call_all(good, 9) == {0: 81, 1: 81, 2: 81}
        assert w.targets == [0, 1, 2]
        registry = w.inspect()["registry"]
        assert [h["hashid"] for h in registry["handles"]] == [good.hashid]


class ExitsAtUnpickle:
    """Unpickling it ends the process (``os._exit(5)``)."""

    def __reduce__(self):
        return (os._exit, (5,))


def test_a_callable_that_kills_its_target_at_unpickle_costs_one_target():
    envelope = callreg._callreg.encode_envelope(pickle.dumps(ExitsAtUnpickle()))
    with callreg.Worker(3) as w:
        good = w.register(square)
        w.start()
        pids = [w.target_pid(t) for t in (1, 2)]
        with pytest.raises(callreg.RegisterError) as info:
            w.register_envelope(envelope)
        error = info.value
        assert error.code == "REGISTER_POISONED"
        assert error.operation == "register"
        assert error.target == 0
        assert error.hashid == callreg.hashid(envelope)
        assert "exited with status 5" in str(error)
        assert list(error.outcomes) == [0]
        assert error.outcomes[0] == "lost (its reply socket closed; it exited with status 5)"
        # Refused from now on, without reaching a target.
        with pytest.raises(callreg.RegisterError) as again:
            w.register_envelope(envelope)
        assert again.value.code == "REGISTER_POISONED"
        assert again.value.target == 0
        assert "exited with status 5" in str(again.value)
        assert again.value.outcomes == {}
        assert [w.target_pid(t) for t in (1, 2)] == pids
        # The lost target is replaced (given what is live, never the
        # poisoned callable): the Worker keeps all its targets.
        _wait_for_target(w, 0, "joined", 1)
        assert w.targets == [0, 1, 2]
        assert w.call_all(good, 3) == {0: 9, 1: 9, 2: 9}
        late = w.register(lambda x: x + 1)
        assert w.call_all(late, 1) == {0: 2, 1: 2, 2: 2}
        # Forgiven, it is tried again on one target (and poisoned again:
        # it kills its probe target once more).
        assert w.forgive(callreg.hashid(envelope)) is True
        assert w.forgive(envelope) is False
        with pytest.raises(callreg.RegisterError) as third:
            w.register_envelope(envelope)
        assert third.value.code == "REGISTER_POISONED"
        assert list(third.value.outcomes) == [0]
        with pytest.raises(ValueError, match="is not a hashid"):
            w.forgive("sha256:zz")
    # Without probing, the same callable reaches every target at once and
    # kills each (replacements off: none is left).
    with callreg.Worker(2, probe_first=False, respawn_limit=0) as w:
        w.start()
        with pytest.raises(callreg.RegisterError) as info:
            w.register_envelope(envelope)
        assert info.value.code == "REGISTER_PARTIAL_FAILURE"
        assert sorted(info.value.outcomes) == [0, 1]
        assert w.targets == []
    with pytest.raises(TypeError, match="probe_first must be True or False"):
        callreg.Worker(1, probe_first=1)


def test_a_large_callable_that_kills_its_probe_leaves_nothing_in_the_targets_that_verified_it_ahead():
    # Over a MiB: targets 1 and 2 receive it to verify while target 0
    # probes it (specs/staging.md step 3); its register never reaches them.
    envelope = callreg._callreg.encode_envelope(pickle.dumps((ExitsAtUnpickle(), b"x" * (2 << 20))))
    with callreg.Worker(3, respawn_limit=0) as w:
        w.start()
        pids = [w.target_pid(t) for t in (1, 2)]
        with pytest.raises(callreg.RegisterError) as info:
            w.register_envelope(envelope)
        assert info.value.code == "REGISTER_POISONED"
        assert list(info.value.outcomes) == [0]
        assert w.targets == [1, 2]
        # A target still hashing lets go of it a few milliseconds later.
        deadline = time.monotonic() + 5
        while any(staged_left(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [staged_left(pid) for pid in pids] == [[], []]
        # A large callable that loads registers on both, through the same
        # path, and serves.
        big = b"y" * (3 << 20)
        h = w.register(lambda x: x + len(big))
        assert w.call_all(h, 1) == {1: 1 + len(big), 2: 1 + len(big)}


def test_metadata_is_filled_in_and_merged():
    with callreg.Worker(2) as w:
        w.start()
        capture = {
            "executor_data": {
                "type": "PythonExecutor",
                "short_name": "python",
                "attributes": {"capture_output": True},
            }
        }
        h = w.register(lambda x: print("got", x) or x + 1, metadata=capture)
        assert w.call(h, 1) == {"result": 2, "stdout": "got 1\n", "stderr": ""}
        missing = {"deps": {"pip": {"packages": ["callreg-no-such-distribution>=1"]}}}
        with pytest.raises(callreg.RegisterError) as info:
            w.register(square, metadata=missing)
        # Refused by the target that tried it first; the other never saw it.
        assert sorted(info.value.outcomes) == [0]
        assert all(o.startswith("failed (DEPS_UNSATISFIED") for o in info.value.outcomes.values())
        wrong = {"python": {"version": "2.7", "serializer": "cloudpickle", "serializer_version": "1"}}
        with pytest.raises(callreg.RegisterError) as info:
            w.register(square, metadata=wrong)
        assert sorted(info.value.outcomes) == [0]
        assert all("PYTHON_VERSION_MISMATCH" in o for o in info.value.outcomes.values())
        with pytest.raises(callreg.CallregError) as info:
            w.register(square, metadata={"no_such_key": 1})
        assert info.value.code == "METADATA_INVALID"
        setter = w.register(set_scale)
        hooked = w.register(
            scaled,
            metadata={"call_before": [{"hashid": setter, "args": [10]}]},
        )
        assert w.call_all(hooked, 4) == {0: 40, 1: 40}
        # A hook's result as a keyword argument needs a JSON task: refused
        # with a clear error for the package's pickled tasks.
        keyword = w.register(
            lambda x, scale: x * scale,
            metadata={"call_before": [{"hashid": setter, "retval_keyword": "scale"}]},
        )
        with pytest.raises(callreg.TaskError, match="needs a JSON-encoded task"):
            w.call(keyword, 1)


SCALE = {}


def set_scale(value):
    SCALE["value"] = value


def scaled(x):
    return x * SCALE["value"]


def test_a_killed_target_fails_its_tasks_and_the_rest_keep_working():
    # Replacements off: the lost target stays out.
    with callreg.Worker(3, respawn_limit=0) as w:
        w.start()
        slow = w.register(sleep_then)
        pid = w.target_pid(1)
        pending = [w.submit(slow, 30, "never", target=1) for _ in range(3)]
        time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        for future in pending:
            error = future.exception(timeout=10)
            assert type(error) is callreg.TargetLostError
            assert error.code == "TARGET_LOST"
            assert error.target == 1
        deadline = time.monotonic() + 5
        while 1 in w.targets and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.targets == [0, 2]
        with pytest.raises(callreg.TargetLostError):
            w.call(slow, 0, 1, target=1)
        assert w.call_all(slow, 0, "ok") == {0: "ok", 2: "ok"}
        assert sorted(set(w.map(slow, [0] * 20, range(20)))) == list(range(20))
        h = w.register(square)
        assert w.call_all(h, 3) == {0: 9, 2: 9}


class ExitsWhenFreed:
    """Ends its process with status 7 when it is garbage collected there,
    unless that is the process that made it."""

    def __init__(self):
        self.maker = os.getpid()

    def __del__(self):
        if os.getpid() != self.maker:
            os._exit(7)


def test_an_unregister_whose_finalizer_exits_says_it_lost_the_targets():
    with callreg.Worker(2) as w:
        w.start()
        held = ExitsWhenFreed()
        h = w.register(lambda: held is not None)
        assert w.call_all(h) == {0: True, 1: True}
        with pytest.raises(callreg.TargetLostError) as info:
            w.unregister(h)
        assert info.value.code == "TARGET_LOST"
        lost = "lost (its reply socket closed; it exited with status 7)"
        assert info.value.outcomes == {0: lost, 1: lost}
        assert str(info.value) == (
            "TARGET_LOST: handle %d is released (a lost target holds nothing of it), but the unregister "
            "lost targets while it was pending there: target 0: lost (its reply socket closed; it exited "
            "with status 7); target 1: lost (its reply socket closed; it exited with status 7) "
            "(operation unregister, namespace LOCAL_PYTHON, hashid %s, seq %d); outcomes: target 0: "
            "lost, target 1: lost"
        ) % (h._raw.handle_id, h.hashid, info.value.seq)
        # Released all the same: stale, and the replacements serve.
        with pytest.raises(callreg.HandleError):
            w.unregister(h)
        deadline = time.monotonic() + 20
        while w.targets != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.call_all(w.register(square), 4) == {0: 16, 1: 16}


def test_a_stale_or_foreign_handle_is_refused_as_such_with_no_live_target():
    # specs/protocol.md §2.5: the handle's checks come before the target's.
    with callreg.Worker(1, respawn_limit=0) as w, callreg.Worker(1, respawn_limit=0) as other:
        w.start()
        other.start()
        h = w.register(abs)
        w.unregister(h)
        os.kill(w.target_pid(0), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while w.targets and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.targets == []
        for call in (lambda: w.call(h, -1), lambda: w.submit(h, -1).result(), lambda: w.call_all(h, -1)):
            with pytest.raises(callreg.HandleError) as stale:
                call()
            assert stale.value.code == "HANDLE_STALE"
        with pytest.raises(callreg.HandleError) as foreign:
            w.call(other.register(abs), -1)
        assert foreign.value.code == "HANDLE_FOREIGN"


def test_a_target_too_slow_to_start_names_the_control_timeout():
    with pytest.raises(callreg.TargetLostError) as caught:
        callreg.Worker(1, control_timeout=1e-6).start()
    assert str(caught.value).startswith(
        "TARGET_LOST: target 0 did not start and was stopped (target 0 sent no ready report within the "
        "control timeout (0.000001 s): give a longer control_timeout) (operation start, target 0"
    )


def test_with_every_target_lost_tasks_fail_no_live_target():
    with callreg.Worker(2, respawn_limit=0) as w:
        w.start()
        h = w.register(square)
        for target in (0, 1):
            os.kill(w.target_pid(target), signal.SIGKILL)
        deadline = time.monotonic() + 5
        while w.targets and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.targets == []
        for attempt in (
            lambda: w.call_all(h, 2),
            lambda: w.call(h, 2),
            lambda: w.submit(h, 2).result(),
            lambda: list(w.map(h, [1, 2])),
        ):
            with pytest.raises(callreg.TargetLostError) as caught:
                attempt()
            assert caught.value.code == "NO_LIVE_TARGET"
            assert re.fullmatch(
                r"NO_LIVE_TARGET: every target is lost, and none is being replaced "
                r"\(operation task, namespace LOCAL_PYTHON, hashid sha256:[0-9a-f]{64}\)",
                str(caught.value),
            )
    # After close: a lifecycle error, not an empty result.
    with pytest.raises(callreg.LifecycleError):
        w.call_all(h, 2)


def test_eight_threads_submitting_at_once():
    with callreg.Worker(4) as w:
        w.start()
        h = w.register(square)
        results = {}
        errors = []
        barrier = threading.Barrier(8)

        def run(n):
            try:
                barrier.wait()
                futures = [w.submit(h, n * 1000 + i) for i in range(200)]
                calls = [w.call(h, n * 1000 + i) for i in range(50)]
                results[n] = ([f.result(timeout=30) for f in futures], calls)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        for n in range(8):
            submitted, called = results[n]
            assert submitted == [(n * 1000 + i) ** 2 for i in range(200)]
            assert called == [(n * 1000 + i) ** 2 for i in range(50)]


def test_a_thousand_futures_in_flight():
    with callreg.Worker(2) as w:
        w.start()
        h = w.register(lambda x: (x, os.getpid()))
        futures = [w.submit(h, i) for i in range(1000)]
        values = [f.result(timeout=60) for f in futures]
        assert [v for v, _ in values] == list(range(1000))
        assert {p for _, p in values} == {w.target_pid(0), w.target_pid(1)}


def test_close_with_futures_pending():
    w = callreg.Worker(2)
    w.start()
    slow = w.register(sleep_then)
    pending = [w.submit(slow, 30, i) for i in range(6)]
    pids = [w.target_pid(t) for t in w.targets]
    started = time.monotonic()
    w.close()
    assert time.monotonic() - started < 5
    for future in pending:
        assert future.done()
        error = future.exception()
        assert type(error) is callreg.LifecycleError
        assert error.code == "LIFECYCLE_INVALID"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    w.close()  # idempotent
    assert w.targets == []
    with pytest.raises(callreg.LifecycleError):
        w.register(square)
    with pytest.raises(callreg.LifecycleError):
        w.submit(slow, 0, 1).result(timeout=1)
    with pytest.raises(callreg.LifecycleError):
        w.call(slow, 0, 1)


def test_lifecycle_errors_before_start_and_double_start():
    with callreg.Worker(1) as w:
        h = w.register(square)
        with pytest.raises(callreg.LifecycleError):
            w.call(h, 2)
        error = w.submit(h, 2).exception(timeout=10)
        assert type(error) is callreg.LifecycleError
        assert str(error) == (
            "LIFECYCLE_INVALID: the Worker is not started: call start() first "
            "(leaving its `with` block only closes it) (operation task)"
        )
        assert w.targets == []
        assert w.target_pid(0) is None
        w.start()
        with pytest.raises(callreg.LifecycleError):
            w.start()
        assert w.call(h, 2) == 4


def test_keyboard_interrupt_during_call_leaves_the_worker_usable():
    with _ctrl_c_handled():
        _interrupt_a_call()


def _interrupt_a_call():
    with callreg.Worker(2) as w:
        w.start()
        slow = w.register(sleep_then)
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            w.call(slow, 3, "late", target=0)
        assert time.monotonic() - started < 2
        timer.join()
        # Targets ignore SIGINT: both are still live and answer.
        assert w.targets == [0, 1]
        assert w.call(slow, 0, "fine", target=1) == "fine"
        assert w.call(slow, 0, "after", target=0) == "after"


def test_a_worker_dropped_without_close_reaps_its_targets():
    w = callreg.Worker(2)
    w.start()
    h = w.register(square)
    assert w.call(h, 5) == 25
    future = w.submit(h, 6)
    assert future.result(timeout=10) == 36
    pids = [w.target_pid(t) for t in w.targets]
    ref = __import__("weakref").ref(w)
    del w, h
    gc.collect()
    assert ref() is None
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_left_open_at_interpreter_exit_is_closed():
    script = textwrap.dedent(
        """
        import os, sys, callreg
        w = callreg.Worker(2)
        w.start()
        h = w.register(lambda x: x + 1)
        assert w.call(h, 1) == 2
        slow = w.register(lambda: __import__("time").sleep(60))
        w.submit(slow)
        print(os.getpid(), *[w.target_pid(t) for t in w.targets], flush=True)
        """
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 20
    parent, *targets = (int(p) for p in done.stdout.split())
    for pid in targets:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert [n for n in os.listdir("/dev/shm") if n.startswith("callreg-%d-" % parent)] == []


def test_fork_runs_the_interpreters_fork_hooks_and_keeps_its_state():
    marker = os.getpid()
    with callreg.Worker(2) as w:
        w.start()
        h = w.register(fork_marks)
        marks = w.call_all(h)
        for target, pids in marks.items():
            assert pids[-1] == w.target_pid(target)
        # The parent ran no child hook.
        assert os.getpid() not in FORKED_CHILD
        # Module state from before start is there in the target.
        assert w.call(w.register(lambda: marker)) == marker


def test_close_with_a_forked_child_of_the_parent_alive_does_not_wait_for_it():
    # The child holds copies of the Worker's control sockets; the targets
    # still read the end at close, not at the kill after the grace (2 s).
    w = callreg.Worker(2)
    w.start()
    assert w.call(w.register(square), 3) == 9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
        child = os.fork()
    if child == 0:
        time.sleep(30)
        os._exit(0)
    try:
        targets = [w.target_pid(t) for t in (0, 1)]
        started = time.monotonic()
        w.close()
        assert time.monotonic() - started < 1.5
        for pid in targets:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_start_with_an_idle_extra_thread_does_not_deadlock():
    stop = threading.Event()
    lock = threading.Lock()

    def idle():
        with lock:
            stop.wait()

    thread = threading.Thread(target=idle)
    thread.start()
    try:
        with callreg.Worker(2) as w:
            # It forks all the same, with a warning about the thread.
            with pytest.warns(RuntimeWarning, match="forkserver"):
                w.start()
            h = w.register(square)
            assert w.call_all(h, 7) == {0: 49, 1: 49}
            # A second Worker forks while the first one's threads run.
            with callreg.Worker(2) as second:
                with pytest.warns(RuntimeWarning, match="forkserver"):
                    second.start()
                assert second.call_all(second.register(square), 3) == {0: 9, 1: 9}
    finally:
        stop.set()
        thread.join()


def test_a_snapshot_entry_that_fails_at_start_fails_its_registration_only():
    envelope = callreg._callreg.encode_envelope(pickle.dumps(Bomb()))
    with callreg.Worker(2) as w:
        good = w.register(square)
        bomb = w.register_envelope(envelope)
        failed = w.start()
        assert list(failed) == [bomb]
        error = failed[bomb]
        assert type(error) is callreg.RegisterError
        assert error.code == "REGISTER_PARTIAL_FAILURE"
        assert error.operation == "start"
        assert error.hashid == bomb.hashid
        assert sorted(error.outcomes) == [0, 1]
        assert all("this payload refuses to load" in o for o in error.outcomes.values())
        # The Worker started with every target; the good entry is live.
        assert w.targets == [0, 1]
        assert w.call_all(good, 6) == {0: 36, 1: 36}
        # The failed handle is no longer live.
        with pytest.raises(callreg.HandleError) as info:
            w.call(bomb)
        assert info.value.code == "HANDLE_STALE"
        # Every target holds the good callable only.
        tables = w.inspect()["targets"]
        assert sorted(tables) == [0, 1]
        for table in tables.values():
            assert table["installed"] == [{"hashid": good.hashid, "refcount": 1}]


def test_two_workers_close_independently():
    first = callreg.Worker(2)
    first.start()
    second = callreg.Worker(2)
    second.start()
    h1, h2 = first.register(square), second.register(square)
    started = time.monotonic()
    first.close()
    # The second Worker's targets never held the first's pipes: closing
    # the first does not wait for its targets' grace period.
    assert time.monotonic() - started < 1.5
    assert second.call_all(h2, 4) == {0: 16, 1: 16}
    second.close()
    with pytest.raises(callreg.LifecycleError):
        first.call(h1, 1)


def test_other_python_threads_run_while_a_caller_waits():
    with callreg.Worker(1) as w:
        w.start()
        slow = w.register(sleep_then)
        ticks = []
        stop = threading.Event()

        def tick():
            while not stop.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.01)

        thread = threading.Thread(target=tick)
        thread.start()
        try:
            started = time.monotonic()
            assert w.call(slow, 0.5, "done") == "done"
            during = [t for t in ticks if t > started]
            # The GIL is released while waiting: the other thread ran all along.
            assert len(during) >= 10
            future = w.submit(slow, 0.3, "later")
            before = len(ticks)
            assert future.result(timeout=10) == "later"
            assert len(ticks) - before >= 5
        finally:
            stop.set()
            thread.join()


def test_default_targets_are_one_per_cpu_and_with_closes():
    with callreg.Worker() as w:
        w.start()
        assert w.targets == list(range(os.cpu_count()))
        pids = [w.target_pid(t) for t in w.targets]
        assert len(set(pids)) == len(pids) and os.getpid() not in pids
    assert w.targets == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# --------------------------------------------------------------------------
# Replacement targets


def _wait_for_target(w, target, phase, incarnation, timeout=20):
    deadline = time.monotonic() + timeout
    while w.target_state(target) != (phase, incarnation):
        assert time.monotonic() < deadline, (w.target_phase(target), w.target_incarnation(target), w.target_events())
        time.sleep(0.005)


def cube(x):
    return x * x * x


def test_a_killed_target_is_replaced_and_holds_every_callable():
    with callreg.Worker(2) as w:
        before = w.register(square)
        w.start()
        after = w.register(cube)
        old = w.target_pid(1)
        os.kill(old, signal.SIGKILL)
        _wait_for_target(w, 1, "joined", 1)
        new = w.target_pid(1)
        assert new != old
        assert w.targets == [0, 1]
        assert w.target_events() == [
            {
                "event": "lost",
                "target": 1,
                "incarnation": 0,
                "cause": "its reply socket closed; it was killed by signal 9",
            },
            {"event": "spawned", "target": 1, "incarnation": 1, "pid": new},
            {"event": "joined", "target": 1, "incarnation": 1},
        ]
        assert w.call(before, 3, target=1) == 9
        assert w.call(after, 3, target=1) == 27
        tables = w.inspect()["targets"]
        assert [tables[t]["incarnation"] for t in (0, 1)] == [0, 1]
        installed = {t: sorted((e["hashid"], e["refcount"]) for e in tables[t]["installed"]) for t in (0, 1)}
        assert installed[0] == installed[1] == sorted([(before.hashid, 1), (after.hashid, 1)])
        assert w.target_incarnation(0) == 0 and w.target_phase(0) == "joined"


def test_target_state_reads_the_phase_and_incarnation_together():
    with callreg.Worker(2) as w:
        assert w.target_state(1) == ("joined", 0)
        w.start()
        assert w.target_state(1) == ("joined", 0)
        os.kill(w.target_pid(1), signal.SIGKILL)
        _wait_for_target(w, 1, "joined", 1)
        assert w.target_state(1) == (w.target_phase(1), w.target_incarnation(1)) == ("joined", 1)
        assert w.target_state(0) == ("joined", 0)
        with pytest.raises(ValueError):
            w.target_state(2)
    assert w.target_state(0) == ("lost", 0)


def test_the_slot_names_are_deprecated_aliases_of_the_target_names():
    with callreg.Worker(2) as w:
        w.start()
        os.kill(w.target_pid(1), signal.SIGKILL)
        _wait_for_target(w, 1, "joined", 1)
        with pytest.warns(DeprecationWarning, match=r"^Worker\.slot_phase is deprecated; use Worker\.target_phase$"):
            assert w.slot_phase(1) == w.target_phase(1) == "joined"
        with pytest.warns(DeprecationWarning, match=r"^Worker\.slot_state is deprecated; use Worker\.target_state$"):
            assert w.slot_state(1) == w.target_state(1) == ("joined", 1)
        with pytest.warns(DeprecationWarning, match=r"^Worker\.slot_events is deprecated; use Worker\.target_events$"):
            events = w.slot_events()
        assert events == w.target_events()
        assert [e["event"] for e in events] == ["lost", "spawned", "joined"]


def test_without_replacements_a_killed_target_stays_lost():
    with callreg.Worker(2, respawn_limit=0) as w:
        w.start()
        os.kill(w.target_pid(1), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while w.target_phase(1) != "lost":
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert w.targets == [0]
        assert w.target_events() == []
        assert w.target_incarnation(1) == 0


def test_a_start_failed_by_a_pre_start_callable_names_the_snapshot():
    killer = callreg._callreg.encode_envelope(pickle.dumps(ExitsAtUnpickle()))
    killer_hashid = callreg.hashid(killer)
    # One entry: the error names it (the target died installing it).
    with callreg.Worker(1, respawn_limit=0) as w:
        w.register_envelope(killer)
        with pytest.raises(callreg.RegisterError) as info:
            w.start()
        assert info.value.hashid == killer_hashid
        assert str(info.value) == (
            "REGISTER_PARTIAL_FAILURE: target 0 could not install the startup snapshot and was stopped "
            "(operation start, target 0, namespace LOCAL_PYTHON, hashid %s); "
            "outcomes: target 0: failed (TARGET_LOST: the target exited with status 5 before it was ready)"
            % killer_hashid
        )
    # Several: which one killed the target is unknown; the message names
    # them all.
    with callreg.Worker(1, respawn_limit=0) as w:
        h = w.register(abs)
        w.register_envelope(killer)
        with pytest.raises(callreg.RegisterError) as info:
            w.start()
        assert info.value.hashid is None
        held = str(info.value).split("(the snapshot held ", 1)[1].split(")", 1)[0]
        assert sorted(held.split(", ")) == sorted([h.hashid, killer_hashid])


def test_a_callable_that_kills_every_new_process_stops_at_the_rate_limit():
    envelope = callreg._callreg.encode_envelope(pickle.dumps(ExitsAtUnpickle()))
    with callreg.Worker(1, respawn_limit=2, respawn_backoff=0.01) as w:
        w.register_envelope(envelope)
        # The target forked at start installs it, and dies.
        with pytest.raises(callreg.RegisterError) as info:
            w.start()
        assert info.value.code == "REGISTER_PARTIAL_FAILURE"
        assert info.value.outcomes == {0: "failed (TARGET_LOST: the target exited with status 5 before it was ready)"}
        _wait_for_target(w, 0, "lost", 2)
        events = [(e["event"], e.get("incarnation", e.get("failed_joins"))) for e in w.target_events()]
        assert events == [
            ("lost", 0),
            ("spawned", 1),
            ("lost", 1),
            ("spawned", 2),
            ("lost", 2),
            ("abandoned", 2),
        ]
        causes = [e["cause"] for e in w.target_events() if e["event"] == "lost"]
        assert causes == [
            "at start: failed (TARGET_LOST: the target exited with status 5 before it was ready)",
            "its reply socket closed; it exited with status 5",
            "its reply socket closed; it exited with status 5",
        ]
        assert w.targets == []


def test_respawn_options_are_checked():
    with pytest.raises(ValueError, match="respawn_limit must be an int from 0 to 65535, got -1"):
        callreg.Worker(1, respawn_limit=-1)
    with pytest.raises(TypeError, match="respawn_limit must be an int, not float"):
        callreg.Worker(1, respawn_limit=1.5)
    with pytest.raises(ValueError, match=r"respawn_backoff must be zero or positive, got -0.5"):
        callreg.Worker(1, respawn_backoff=-0.5)
    with pytest.raises(TypeError, match="respawn_backoff must be a number of seconds, not str"):
        callreg.NextLevel(1, respawn_backoff="1")
    with pytest.raises(TypeError, match="probe_first must be True or False, not int"):
        callreg.NextLevel(1, probe_first=1)
    # Longer than a deadline can be: refused, never a panic.
    for name in ("control_timeout", "operation_timeout", "respawn_backoff"):
        with pytest.raises(ValueError) as info:
            callreg.Worker(1, **{name: 1e300})
        assert str(info.value) == "%s must be at most 1000000000 seconds, got 1e300" % name
        with pytest.raises(ValueError, match="%s must be at most 1000000000 seconds" % name):
            callreg.NextLevel(1, **{name: 1e300})
    level = callreg.NextLevel(1, respawn_limit=0, respawn_backoff=2, probe_first=False)
    assert (level.respawn_limit, level.respawn_backoff, level.probe_first) == (0, 2, False)


def test_a_forked_child_cannot_use_nor_close_the_worker():
    with callreg.Worker(2) as w:
        w.start()
        h = w.register(square)
        pids = [w.target_pid(t) for t in w.targets]
        child = os.fork()
        if child == 0:
            code = 1
            try:
                try:
                    w.call(h, 2)
                except callreg.LifecycleError as error:
                    if str(error).startswith("LIFECYCLE_INVALID: this Worker belongs to process %d" % os.getppid()):
                        code = 2
                if code == 2 and w.targets == [] and type(w.submit(h, 2).exception(5)) is callreg.LifecycleError:
                    code = 3
                try:
                    w.forgive(h)
                    code = 4
                except callreg.LifecycleError:
                    pass
                w.close()
                del w
                gc.collect()
                code = 0 if code == 3 else code
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert [w.target_pid(t) for t in w.targets] == pids
        assert w.call_all(h, 3) == {0: 9, 1: 9}


def test_futures_copied_into_a_forked_child_resolve_there_at_once_whoever_held_them():
    # At the fork, one future is waited on by a thread of the parent (it
    # holds the task), one has a done-callback (the dispatcher's), one
    # nobody touched: in the child each fails at once with the Worker's
    # LIFECYCLE_INVALID (specs/python.md §3, "Forked children").
    with callreg.Worker(1) as w:
        w.start()
        h = w.register(nap)
        held, armed, idle = (w.submit(h, 0.5) for _ in range(3))
        waiter = threading.Thread(target=held.result)
        waiter.start()
        armed.add_done_callback(lambda _: None)
        time.sleep(0.2)
        child = os.fork()
        if child == 0:
            code = 1
            try:
                owner = "LIFECYCLE_INVALID: this Worker belongs to process %d; process %d is a child forked from it" % (
                    os.getppid(),
                    os.getpid(),
                )
                started = time.monotonic()
                errors = [future.exception(5) for future in (held, armed, idle)]
                code = sum(
                    1 << i
                    for i, e in enumerate(errors)
                    if not (type(e) is callreg.LifecycleError and str(e).startswith(owner))
                )
                if code == 0 and time.monotonic() - started >= 1:
                    code = 8
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        waiter.join()
        assert [future.result() for future in (held, armed, idle)] == [0.5, 0.5, 0.5]


def collect_garbage():
    return gc.collect() >= 0


def test_an_unclosed_garbage_worker_inherited_by_targets_is_left_alone(capfd):
    old = callreg.Worker(1)
    old.start()
    cycle = [old]
    cycle.append(cycle)  # only the garbage collector frees it
    old_pid = old.target_pid(0)
    del old, cycle
    gc.disable()
    try:
        with callreg.Worker(2) as w:
            w.start()
            collect = w.register(collect_garbage)
            # Each target frees its copy of the old Worker: nothing of the
            # owner's is touched.
            assert w.call_all(collect) == {0: True, 1: True}
            h = w.register(square)
            assert w.call_all(h, 4) == {0: 16, 1: 16}
            os.kill(old_pid, 0)  # the old Worker's target still runs
    finally:
        gc.enable()
    gc.collect()
    # Nothing went wrong in the targets (they write to this stderr).
    assert capfd.readouterr().err == ""


def test_no_other_process_can_open_a_targets_channels_to_forge_a_reply():
    import errno

    with callreg.Worker(1) as w:
        w.start()
        pid = w.target_pid(0)
        base = "/proc/%d/fd" % pid
        parents = {os.readlink("/proc/self/fd/%s" % name) for name in os.listdir("/proc/self/fd") if _readable(name)}
        own = {}
        for name in os.listdir(base):
            link = os.readlink("%s/%s" % (base, name))
            if link.startswith(("pipe:", "socket:")) and link not in parents:
                own[name] = link
        # Its own channel ends (not inherited): control and reply, sockets.
        assert sorted(link.split(":")[0] for link in own.values()) == ["socket", "socket"]
        for name in own:
            with pytest.raises(OSError) as info:
                os.open("%s/%s" % (base, name), os.O_WRONLY)
            assert info.value.errno == errno.ENXIO
        h = w.register(square)
        assert w.call(h, 3) == 9


def _readable(name):
    try:
        os.readlink("/proc/self/fd/%s" % name)
        return True
    except OSError:
        return False


def test_a_stopped_probe_target_poisons_nothing():
    # The lowest live target is the probe target; stopped, it sends no
    # alive report and is fenced for silence: no evidence against the
    # callable, which then registers on the others.
    with callreg.Worker(2, control_timeout=0.3, respawn_limit=0) as w:
        w.start()
        os.kill(w.target_pid(0), signal.SIGSTOP)
        with pytest.raises(callreg.RegisterError) as info:
            w.register(square)
        assert info.value.code == "REGISTER_PARTIAL_FAILURE"
        assert info.value.outcomes == {
            0: "fenced (it sent no alive report for a control timeout and was fenced; it was killed by signal 9)"
        }
        assert w.targets == [1]
        h = w.register(square)
        assert w.call_all(h, 5) == {1: 25}


def test_an_operation_timeout_shorter_than_the_control_timeout_is_refused():
    with pytest.raises(
        ValueError, match=r"^the operation timeout \(0.5 s\) must be at least the control timeout \(2 s\)$"
    ):
        callreg.Worker(1, control_timeout=2, operation_timeout=0.5)
    # Equal is allowed.
    callreg.Worker(1, control_timeout=2, operation_timeout=2).close()


STARTED_IN_A_THREAD = """
import os, threading, time
import callreg

def square(x):
    return x * x

w = callreg.Worker(2)
starter = threading.Thread(target=w.start)
starter.start()
starter.join()
time.sleep(0.3)  # the thread that called start() is gone
h = w.register(square)
children = set()
for task in os.listdir("/proc/self/task"):
    with open("/proc/self/task/%s/children" % task) as f:
        children.update(int(p) for p in f.read().split())
print(w.call_all(h, 3), w.targets, sorted(children), flush=True)
time.sleep(60)
"""


def _gone(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_targets_outlive_the_thread_that_started_them_but_not_the_process():
    children = []
    proc = subprocess.Popen([sys.executable, "-c", STARTED_IN_A_THREAD], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("{0: 9, 1: 9} [0, 1] ["), line
        children = [int(p) for p in line.rsplit("[", 1)[1].rstrip("]\n").split(", ")]
        # Two targets and the template of replacements, all alive.
        assert len(children) == 3 and not any(_gone(p) for p in children), line
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in children):
        assert time.monotonic() < deadline, [p for p in children if not _gone(p)]
        time.sleep(0.02)


def _nested(depth, limit):
    """A list nested ``depth`` deep, made with the recursion limit raised
    to ``limit`` (in the process that pickles it)."""
    sys.setrecursionlimit(limit)
    value = 1
    for _ in range(depth):
        value = [value]
    return value


def _depth(value):
    depth = 0
    while isinstance(value, list):
        value = value[0]
        depth += 1
    return depth


def _pickled_in_a_thread(depth, limit):
    """What pickling ``_nested(depth, limit)`` gives in a new thread of
    this process: ``None``, or the name of the exception it raised (on
    Python 3.12 and later, whose C recursion is bounded on its own,
    cloudpickle's ``PicklingError``)."""
    outcome = []

    def run():
        try:
            cloudpickle.dumps(_nested(depth, limit), protocol=pickle.HIGHEST_PROTOCOL)
            outcome.append(None)
        except BaseException as error:
            kind = type(error)
            # Named as a TaskError names a remote exception's type.
            module = "" if kind.__module__ == "builtins" else kind.__module__ + "."
            outcome.append(module + kind.__qualname__)

    before = sys.getrecursionlimit()
    try:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    finally:
        sys.setrecursionlimit(before)
    return outcome[0]


_STACK = resource.getrlimit(resource.RLIMIT_STACK)[0]


@pytest.mark.skipif(
    _STACK == resource.RLIM_INFINITY or _STACK < 8 << 20,
    reason="needs a soft RLIMIT_STACK of 8 MiB or more (a thread's default stack)",
)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_deeply_nested_result_pickles_as_deep_as_in_a_thread_here(start_method):
    # 16,000 deep overflowed a target's 2 MiB task thread (the target died
    # of SIGSEGV); a thread of this interpreter has RLIMIT_STACK, and so
    # do a target's task and control threads.
    depth, limit = 16000, 100000
    expected = _pickled_in_a_thread(depth, limit)
    with callreg.Worker(1, start_method=start_method) as w:
        w.start()
        h = w.register(_nested)
        if expected is None:
            assert _depth(w.call(h, depth, limit, timeout=60)) == depth
        else:
            # The pickling error itself, as a thread here raises it (a
            # result that does not pickle raises what pickling raised).
            with pytest.raises(Exception) as raised:
                w.call(h, depth, limit, timeout=60)
            kind = type(raised.value)
            module = "" if kind.__module__ == "builtins" else kind.__module__ + "."
            assert module + kind.__qualname__ == expected
            assert not isinstance(raised.value, callreg.TaskError)
            assert raised.value.__cause__.remote_type == expected
        assert w.call(h, 3, 1000) == [[[1]]]


def _close_the_task_threads_wait():
    # The task thread's epoll instance is the target's first one (made
    # before the reader's).
    polls = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink("/proc/self/fd/" + name) == "anon_inode:[eventpoll]":
                polls.append(int(name))
        except OSError:
            pass  # the directory's own descriptor, closed by now
    os.close(min(polls))
    return "closed"


def test_a_task_that_closes_its_targets_wait_ends_that_target_with_status_108(capfd):
    # Before, the task thread spun on the failed wait for good, a CPU
    # busy and nothing reported.
    with callreg.Worker(1, respawn_limit=1) as w:
        w.start()
        pid = w.target_pid(0)
        assert w.call(w.register(_close_the_task_threads_wait)) == "closed"
        deadline = time.monotonic() + 10
        while not any(e["event"] == "lost" for e in w.target_events()):
            assert time.monotonic() < deadline, w.target_events()
            time.sleep(0.01)
        causes = [e["cause"] for e in w.target_events() if e["event"] == "lost"]
        # Whichever the parent saw first: the pidfd or the reply socket.
        assert causes in (
            ["its process ended; it exited with status 108"],
            ["its reply socket closed; it exited with status 108"],
        ), causes
        assert "callreg target (pid %d): the task thread's wait failed: EBADF" % pid in capfd.readouterr().err
        # The replacement serves.
        deadline = time.monotonic() + 20
        while w.targets != [0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.call(w.register(square), 5) == 25
