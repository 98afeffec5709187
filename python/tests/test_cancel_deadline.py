"""Cancelling tasks that have not started, and task deadlines
(specs/protocol.md §2.11, §2.12): a cancelled task never runs, a task
past its deadline fails with TaskTimeoutError, its target is killed and
replaced, and the other targets are unaffected."""

import concurrent.futures
import os
import signal
import time

import pytest

import callreg


def touch_after(path, seconds):
    """Sleeps, then writes ``path``: the side effect a cancelled task
    would leave."""
    time.sleep(seconds)
    with open(path, "w") as f:
        f.write("ran")
    return os.getpid()


def start_then_touch(started, path, seconds):
    """Writes ``started``, then does as :func:`touch_after`: a task whose
    start a test can wait for."""
    with open(started, "w") as f:
        f.write("started")
    return touch_after(path, seconds)


def spin(seconds):
    """Holds its target for ``seconds``, then returns its pid."""
    time.sleep(seconds)
    return os.getpid()


def pid():
    return os.getpid()


def wait_until(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in %s s" % seconds)
        time.sleep(0.01)


def test_a_queued_task_cancelled_never_runs_and_its_future_is_cancelled(tmp_path):
    with callreg.Worker(1) as w:
        w.start()
        h = w.register(touch_after)
        first = w.submit(w.register(start_then_touch), str(tmp_path / "started"), str(tmp_path / "first"), 0.5)
        queued = w.submit(h, str(tmp_path / "queued"), 0.0)
        # The first one runs (a loaded machine may start it late).
        wait_until(lambda: (tmp_path / "started").exists())
        called = []
        queued.add_done_callback(called.append)
        assert queued.cancel() is True
        assert queued.cancelled() and queued.done()
        assert queued.cancel() is True  # again: still cancelled
        with pytest.raises(concurrent.futures.CancelledError):
            queued.result()
        assert called == [queued]
        # The running one cannot be cancelled and finishes.
        assert first.cancel() is False
        assert first.result() == w.call(w.register(pid))
        time.sleep(0.2)  # the queued one would have run by now
        assert sorted(os.listdir(tmp_path)) == ["first", "started"]


def test_cancel_of_a_finished_task_is_false_and_wait_counts_a_cancelled_future_done(tmp_path):
    with callreg.Worker(1) as w:
        w.start()
        h = w.register(touch_after)
        done = w.submit(h, str(tmp_path / "done"), 0.0)
        assert done.result() > 0
        assert done.cancel() is False and not done.cancelled()
        busy = w.submit(h, str(tmp_path / "busy"), 0.5)
        queued = w.submit(h, str(tmp_path / "queued"), 0.0)
        assert queued.cancel() is True
        finished, pending = concurrent.futures.wait([busy, queued], timeout=10)
        assert (finished, pending) == ({busy, queued}, set())
        assert not os.path.exists(tmp_path / "queued")


def test_leaving_map_early_cancels_the_tasks_not_started(tmp_path):
    with callreg.Worker(1) as w:
        w.start()
        h = w.register(touch_after)
        paths = [str(tmp_path / ("item%d" % i)) for i in range(6)]
        results = w.map(h, paths, [0.3] * 6)
        next(results)  # the first ran
        results.close()  # the rest are cancelled if not started
        time.sleep(1.0)
        ran = sorted(os.listdir(tmp_path))
        # The first, and at most the one running when the iterator closed.
        assert ran[:1] == ["item0"] and len(ran) <= 2, ran


def test_executor_shutdown_cancel_futures_cancels_what_has_not_started(tmp_path):
    ex = callreg.Executor(1)
    running = ex.submit(touch_after, str(tmp_path / "running"), 0.5)
    queued = [ex.submit(touch_after, str(tmp_path / ("q%d" % i)), 0.0) for i in range(3)]
    time.sleep(0.1)  # the first has started
    ex.shutdown(wait=True, cancel_futures=True)
    assert running.result() > 0
    assert [f.cancelled() for f in queued] == [True, True, True]
    assert sorted(os.listdir(tmp_path)) == ["running"]


def test_a_task_past_its_deadline_raises_task_timeout_error_and_its_target_is_replaced():
    with callreg.Worker(2, respawn_backoff=0.01) as w:
        w.start()
        h = w.register(spin)
        before = {t: w.target_pid(t) for t in (0, 1)}
        other = w.submit(h, 0.3, target=1)
        started = time.monotonic()
        late = w.submit(h, 30.0, target=0, timeout=0.5)
        with pytest.raises(callreg.TaskTimeoutError) as info:
            late.result(timeout=20)
        elapsed = time.monotonic() - started
        assert 0.5 <= elapsed < 5.0, elapsed
        error = info.value
        assert isinstance(error, TimeoutError) and isinstance(error, callreg.CallregError)
        assert (error.code, error.operation, error.target) == ("TASK_DEADLINE", "task", 0)
        # The other target is unaffected.
        assert other.result(timeout=10) == before[1]
        # Target 0 was killed and is replaced with a new process.
        wait_until(lambda: 0 in w.targets and w.target_pid(0) not in (None, before[0]))
        assert w.target_incarnation(0) == 1
        with pytest.raises(ProcessLookupError):
            os.kill(before[0], 0)
        assert w.call(h, 0.0, target=0) == w.target_pid(0)


def test_a_deadline_hands_the_tasks_queued_behind_it_to_the_replacement():
    with callreg.Worker(1, respawn_backoff=0.01) as w:
        w.start()
        h = w.register(spin)
        first = w.target_pid(0)
        late = w.submit(h, 30.0, timeout=0.3)
        behind = w.submit(h, 0.0)
        with pytest.raises(callreg.TaskTimeoutError):
            late.result(timeout=20)
        # It never started on the fenced process: it runs, once, on the
        # replacement.
        ran_on = behind.result(timeout=20)
        assert ran_on not in (None, first)
        assert ran_on == w.target_pid(0)


def mark(directory, i, seconds):
    """Appends this process's pid to ``directory/i`` (one line per run),
    then holds its target for ``seconds``."""
    with open(os.path.join(directory, str(i)), "a") as f:
        f.write("%d\n" % os.getpid())
    time.sleep(seconds)
    return os.getpid()


def test_a_deadline_counts_from_the_task_start_not_its_submit():
    # 100 tasks of 50 ms on 2 targets: the last start 2.5 s after their
    # submit, each runs well within its 1 s.
    with callreg.Executor(2) as ex:
        futures = [ex.submit(callreg.options(spin, timeout=1.0), 0.05) for _ in range(100)]
        errors = [f.exception(timeout=60) for f in futures]
    assert errors == [None] * 100


def test_a_killed_target_costs_only_the_task_it_was_running(tmp_path):
    with callreg.Worker(2, respawn_backoff=0.01) as w:
        w.start()
        pids = {t: w.target_pid(t) for t in (0, 1)}
        h = w.register(start_then_touch)
        m = w.register(mark)
        started = tmp_path / "started"
        running = w.submit(h, str(started), str(tmp_path / "never"), 30.0)
        holding = w.submit(m, str(tmp_path), "holder", 1.0)
        markers = tmp_path / "markers"
        markers.mkdir()
        # Placed by the fewest tasks in flight: 20 queue behind each.
        queued = [w.submit(m, str(markers), i, 0.0) for i in range(40)]
        wait_until(started.exists)
        victim = w.target_pid(0)
        assert victim == pids[0]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(callreg.TargetLostError) as info:
            running.result(timeout=20)
        assert "killed by signal 9" in str(info.value)
        ran_on = [f.result(timeout=30) for f in queued]
        assert holding.result(timeout=20) == pids[1]
    # Every queued task ran exactly once, none on the killed process.
    runs = {int(p.name): p.read_text().split() for p in markers.iterdir()}
    assert sorted(runs) == list(range(40))
    assert all(len(lines) == 1 for lines in runs.values()), runs
    assert victim not in ran_on
    assert not (tmp_path / "never").exists()


def test_call_and_executor_options_take_a_deadline():
    with callreg.Worker(1, respawn_backoff=0.01) as w:
        w.start()
        h = w.register(spin)
        with pytest.raises(callreg.TaskTimeoutError):
            w.call(h, 30.0, timeout=0.3)
        with pytest.raises(ValueError, match="timeout must be positive, got -1"):
            w.submit(h, 0.0, timeout=-1)
    with callreg.Executor(1) as ex:
        quick = callreg.options(spin, timeout=10.0)
        assert repr(quick).startswith("callreg.options(")
        assert ex.submit(quick, 0.0).result() > 0
        with pytest.raises(callreg.TaskTimeoutError):
            ex.submit(callreg.options(spin, timeout=0.3), 30.0).result(timeout=20)
        # Its target was killed; its replacement serves once it joined.
        wait_until(lambda: ex.worker.targets == [0])
        pids = list(ex.map(callreg.options(spin, timeout=10.0), [0.0, 0.0]))
        assert len(pids) == 2 and pids[0] == pids[1] > 0  # one target


def test_an_executor_keyword_named_timeout_goes_to_the_callable():
    def takes_timeout(timeout, target):
        return (timeout, target)

    with callreg.Executor(1) as ex:
        assert ex.submit(takes_timeout, timeout=5, target="x").result() == (5, "x")


def test_a_stopped_target_does_not_keep_a_deadline_from_passing():
    with callreg.Worker(1, respawn_backoff=0.01) as w:
        w.start()
        h = w.register(spin)
        victim = w.target_pid(0)
        late = w.submit(h, 30.0, timeout=0.5)
        time.sleep(0.1)
        os.kill(victim, signal.SIGSTOP)
        with pytest.raises(callreg.TaskTimeoutError):
            late.result(timeout=20)
        wait_until(lambda: w.target_pid(0) not in (None, victim))
