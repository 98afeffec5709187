"""Trees of Workers: next-level targets that build an inner Worker and run
orchestration callables with their context, over real processes."""

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import callreg

# --------------------------------------------------------------------------
# Helpers


def running(pid):
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def exists(pid):
    return os.path.exists("/proc/%d" % pid)


def parent_of(pid):
    with open("/proc/%d/stat" % pid) as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def shm_of(pids):
    """Staged payload names in /dev/shm left by any of ``pids``."""
    prefixes = tuple("callreg-%d-" % pid for pid in pids)
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefixes))


def square(x):
    return x * x


def setup_square(inner):
    return {"square": inner.register(square)}


def sum_of_squares(ctx, n):
    """Maps the inner handle over range(n), spread over the inner targets."""
    return sum(ctx.inner.map(ctx.handles["square"], range(n)))


def square_everywhere(ctx, x):
    """One inner task per inner target; the sum of their results."""
    return sum(ctx.inner.call_all(ctx.handles["square"], x).values())


def tree_pids(ctx):
    """This next-level child's pid and its inner targets' pids."""
    return os.getpid(), {t: ctx.inner.target_pid(t) for t in ctx.inner.targets}


def inner_hashids(ctx):
    return sorted(d["hashid"] for d in ctx.inner.inspect()["registry"]["digests"])


def call_inner(ctx, target, x):
    return ctx.inner.call(ctx.handles["square"], x, target=target)


def level_and_pid(*args):
    """On a SUB target: ("sub", pid); with a context: ("next", pid, target)."""
    if args and isinstance(args[0], callreg.Context):
        return "next", os.getpid(), args[0].target
    return "sub", os.getpid()


def tree(sub=1, inner=3, upper=2, setup=setup_square, respawn_limit=3):
    return callreg.Worker(
        sub,
        next_level=callreg.NextLevel(inner, setup=setup, respawn_limit=respawn_limit),
        next_level_targets=upper,
        respawn_limit=respawn_limit,
    )


# --------------------------------------------------------------------------
# A three-level tree


def test_a_three_level_tree_runs_orchestration_callables_over_its_inner_targets():
    w = tree()
    with w:
        before = w.register(sum_of_squares)  # joins the startup snapshot
        w.start()
        assert w.targets == [0, 1, 2]
        assert w.sub_targets == [0]
        assert w.next_level_targets == [1, 2]
        # Level 1 -> 2: registered after start, reaches both kinds.
        where = w.register(level_and_pid)
        sub, upper = w.call(where, target=0), [w.call(where, target=t) for t in (1, 2)]
        assert sub == ("sub", w.target_pid(0))
        assert upper == [("next", w.target_pid(1), 1), ("next", w.target_pid(2), 2)]
        # Level 2 -> 3: an inner handle mapped over the inner targets.
        expected = sum(x * x for x in range(50))
        assert w.call(before, 50, target=1) == expected
        assert w.call(before, 50, target=2) == expected
        everywhere = w.register(square_everywhere)
        assert {t: w.call(everywhere, 7, target=t) for t in (1, 2)} == {1: 147, 2: 147}
        # Registrations at the inner level, from an orchestration callable.
        register_inner = w.register(lambda ctx, k: ctx.inner.call_all(ctx.inner.register(lambda x: x + k), 1))
        assert w.call(register_inner, 10, target=1) == {0: 11, 1: 11, 2: 11}
        # Every inner target is a child of its next-level target.
        pids = w.register(tree_pids)
        tree_map = {t: w.call(pids, target=t) for t in (1, 2)}
        grandchildren = []
        for t, (pid, inner) in tree_map.items():
            assert pid == w.target_pid(t)
            assert sorted(inner) == [0, 1, 2]
            for inner_pid in inner.values():
                assert parent_of(inner_pid) == pid
                grandchildren.append(inner_pid)
        assert len(set(grandchildren)) == 6
        children = [w.target_pid(t) for t in w.targets]
    # Closing stops every level: the next-level children closed their inner
    # Workers (reaped, not just killed) before exiting.
    everyone = children + grandchildren
    assert wait_until(lambda: not any(exists(p) for p in everyone)), [p for p in everyone if exists(p)]
    assert shm_of(everyone + [os.getpid()]) == []


def test_the_same_orchestration_callable_twice_counts_at_the_next_level_only():
    def orchestrate(ctx, x):
        return ctx.inner.call(ctx.handles["square"], x) + 1

    with tree(sub=0, inner=2, upper=2) as w:
        w.start()
        inner_before = w.register(inner_hashids)
        setup_only = [callreg.hashid(square)]
        first = w.register(orchestrate)
        second = w.register(orchestrate)
        assert first.hashid == second.hashid and first != second
        tables = w.inspect()["targets"]
        assert sorted(tables) == [0, 1]
        for table in tables.values():
            counts = {e["hashid"]: e["refcount"] for e in table["installed"]}
            assert counts == {inner_before.hashid: 1, first.hashid: 2}
        # Nothing of it in the inner registries.
        for t in (0, 1):
            assert w.call(inner_before, target=t) == setup_only
        assert w.call(first, 5, target=0) == 26
        w.unregister(first)
        for table in w.inspect()["targets"].values():
            assert {e["hashid"]: e["refcount"] for e in table["installed"]}[second.hashid] == 1
        assert w.call(second, 6, target=1) == 37
        w.unregister(second)
        for table in w.inspect()["targets"].values():
            assert [e["hashid"] for e in table["installed"]] == [inner_before.hashid]
        for t in (0, 1):
            assert w.call(inner_before, target=t) == setup_only


def test_a_tree_of_any_depth():
    def setup_middle(inner):
        # inner is a Worker whose target 0 is a next-level target itself.
        return {"down": inner.register(lambda ctx, x: ("leaf", ctx.inner.call(ctx.handles["square"], x)))}

    deepest = callreg.NextLevel(1, setup=setup_square)
    middle = callreg.NextLevel(0, setup=setup_middle, next_level=deepest, next_level_targets=1)
    with callreg.Worker(0, next_level=middle) as w:
        w.start()
        assert w.next_level_targets == [0]
        top = w.register(lambda ctx, x: ("middle", ctx.inner.call(ctx.handles["down"], x, target=0)))
        assert w.call(top, 9, target=0) == ("middle", ("leaf", 81))


def test_a_setup_that_raises_loses_its_next_level_target_at_start(capfd):
    def broken(inner):
        raise RuntimeError("setup refused")

    with callreg.Worker(1, next_level=callreg.NextLevel(1, setup=broken)) as w:
        with pytest.raises(callreg.TargetLostError) as info:
            w.start()
        assert info.value.code == "TARGET_LOST"
        assert info.value.target == 1
        assert sorted(info.value.outcomes) == [0, 1]
        assert info.value.outcomes[0] == "ok"
        # Why, with the setup's innermost frames.
        assert info.value.outcomes[1].startswith(
            "failed (TARGET_LOST: the target could not start: RuntimeError: "
            "the target initializer failed: setup refused\nTraceback (most recent call last):\n"
        ), info.value.outcomes[1]
        assert 'raise RuntimeError("setup refused")' in info.value.outcomes[1]
        assert w.targets == [0]
    assert "RuntimeError: setup refused" in capfd.readouterr().err


def _refuse(message):
    raise ValueError(message)


class Bomb:
    """Unpickles by raising ValueError (on every target)."""

    def __reduce__(self):
        return (_refuse, ("this payload refuses to load",))


def test_a_setup_registration_that_fails_in_the_inner_targets_loses_the_next_level_target(capfd):
    def setup(inner):
        envelope = callreg._callreg.encode_envelope(pickle.dumps(Bomb()))
        return {"bomb": inner.register_envelope(envelope)}

    with callreg.Worker(1, next_level=callreg.NextLevel(2, setup=setup)) as w:
        with pytest.raises(callreg.TargetLostError) as info:
            w.start()
        assert info.value.target == 1
        assert w.targets == [0]
    err = capfd.readouterr().err
    assert "callreg.RegisterError" in err
    assert "this payload refuses to load" in err


def test_bad_tree_arguments_are_refused():
    with pytest.raises(ValueError, match="next_level_targets needs next_level"):
        callreg.Worker(1, next_level_targets=2)
    with pytest.raises(TypeError, match="next_level must be a callreg.NextLevel"):
        callreg.Worker(1, next_level={"targets": 2})
    with pytest.raises(ValueError, match="^targets must be an int from 1 to 65535, got 0$"):
        callreg.Worker(0)
    with pytest.raises(TypeError, match="setup must be a callable"):
        callreg.NextLevel(2, setup=42)
    with pytest.raises(ValueError, match="^next_level_targets must be an int from 1 to 65535, got 0$"):
        callreg.NextLevel(2, next_level=callreg.NextLevel(1), next_level_targets=0)
    with pytest.raises(ValueError, match="^targets must be between 0 and 65533 with 2 next-level targets, got 65534$"):
        callreg.Worker(65534, next_level=callreg.NextLevel(1), next_level_targets=2)
    # A NextLevel's options are checked when it is built, by the builder
    # of the inner Worker (not only at start, in the next-level child).
    with pytest.raises(ValueError) as info:
        callreg.NextLevel(1, control_timeout=2, operation_timeout=1)
    assert str(info.value) == "the operation timeout (1 s) must be at least the control timeout (2 s)"
    with pytest.raises(ValueError, match="^max_frame_bytes must be an int from 256 to 18446744073709551615, got 100$"):
        callreg.NextLevel(1, max_frame_bytes=100)
    with pytest.raises(ValueError, match="^targets must be an int from 1 to 65535, got 0$"):
        callreg.NextLevel(0)


def channels_of(pid, kind):
    """The inodes (``"pipe:[N]"``, ``"socket:[N]"``) of the pipes or sockets
    (``kind``) process ``pid`` holds open."""
    found = set()
    base = "/proc/%d/fd" % pid
    for fd in os.listdir(base):
        try:
            link = os.readlink("%s/%s" % (base, fd))
        except OSError:
            continue
        if link.startswith(kind + ":["):
            found.add(link)
    return found


def test_inner_targets_do_not_hold_their_next_level_targets_channels():
    with tree(sub=1, inner=2, upper=1) as w:
        w.start()
        pids = w.register(tree_pids)
        pid, inner = w.call(pids, target=1)
        sibling = w.target_pid(0)
        # Its sockets (one inode per end), held by neither this process nor
        # the sibling SUB target (which inherited the rest): its control and
        # reply ends, its inner Worker's control and reply ends of each of
        # its 2 inner targets, its end of the inner Worker's template
        # process (replacements), and both ends of the inner Worker's two
        # wake-up socket pairs.
        sockets = channels_of(pid, "socket") - channels_of(sibling, "socket") - channels_of(os.getpid(), "socket")
        assert len(sockets) == 11
        for inner_pid in inner.values():
            assert channels_of(inner_pid, "socket") & sockets == set()
            # Nor any pipe (only the standard streams are shared).
            shared = channels_of(inner_pid, "pipe") & channels_of(pid, "pipe")
            assert shared - channels_of(os.getpid(), "pipe") == set()


# --------------------------------------------------------------------------
# Failure containment


def test_killing_an_inner_target_then_a_next_level_child():
    # Replacements off at both levels: this is about what a loss does.
    with tree(sub=1, inner=3, upper=2, respawn_limit=0) as w:
        w.start()
        pids = w.register(tree_pids)
        inner_call = w.register(call_inner)
        everywhere = w.register(square_everywhere)
        pid1, inner1 = w.call(pids, target=1)
        pid2, inner2 = w.call(pids, target=2)

        # An inner SUB target dies: the inner Worker loses it, the
        # orchestration callable sees TargetLostError, the rest works.
        os.kill(inner1[1], signal.SIGKILL)
        assert wait_until(lambda: not exists(inner1[1]))  # reaped by its parent
        with pytest.raises(callreg.TaskError) as info:
            w.call(inner_call, 1, 3, target=1)
        assert info.value.remote_type == "callreg.TargetLostError"
        lost = info.value.__cause__
        assert isinstance(lost, callreg.TargetLostError)
        assert lost.code == "TARGET_LOST" and lost.target == 1
        assert w.call(pids, target=1) == (pid1, {0: inner1[0], 2: inner1[2]})
        assert w.call(everywhere, 3, target=1) == 18
        assert w.call(everywhere, 3, target=2) == 27

        # A next-level child dies: its subtree goes with it, the outer
        # Worker loses that target and keeps the others.
        os.kill(pid2, signal.SIGKILL)
        assert wait_until(lambda: 2 not in w.targets)
        assert wait_until(lambda: not any(running(p) for p in inner2.values()))
        with pytest.raises(callreg.TargetLostError):
            w.call(everywhere, 3, target=2)
        assert w.targets == [0, 1]
        assert w.call(everywhere, 4, target=1) == 32
        square_h = w.register(square)
        assert w.call(square_h, 5, target=0) == 25
        everyone = [w.target_pid(0), pid1, pid2] + list(inner1.values()) + list(inner2.values())
    assert wait_until(lambda: not any(running(p) for p in everyone))
    assert shm_of(everyone) == []


def test_killing_the_outer_parent_takes_the_whole_tree():
    here = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(
        """
        import json, os, sys, time
        sys.path.insert(0, %r)
        import callreg
        import test_tree
        w = test_tree.tree(sub=1, inner=3, upper=2)
        w.start()
        pids = w.register(test_tree.tree_pids)
        found = [w.target_pid(0)]
        for t in (1, 2):
            pid, inner = w.call(pids, target=t)
            found += [pid] + list(inner.values())
        print(json.dumps(found), flush=True)
        time.sleep(120)
        """
        % here
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        pids = json.loads(line)
        assert len(pids) == 9 and all(running(p) for p in pids)
        parent.kill()
        assert parent.wait(30) == -signal.SIGKILL
        assert wait_until(lambda: not any(running(p) for p in pids)), [p for p in pids if running(p)]
        assert shm_of(pids + [parent.pid]) == []
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


# --------------------------------------------------------------------------
# Mixed scopes


def _refuse_on_next_level():
    if callreg.context() is not None:
        raise ValueError("refused on a next-level target")
    return square


class NextLevelBomb:
    """Unpickles to ``square`` on a SUB target, raises on a next-level one."""

    def __reduce__(self):
        return (_refuse_on_next_level, ())


def _exit_on_next_level():
    if callreg.context() is not None:
        os._exit(7)
    return square


class NextLevelExit:
    """Unpickles to ``square`` on a SUB target; ends a next-level one."""

    def __reduce__(self):
        return (_exit_on_next_level, ())


def installed(w):
    return {t: sorted(e["hashid"] for e in table["installed"]) for t, table in w.inspect()["targets"].items()}


def test_a_payload_failing_on_the_next_level_kind_only_is_rolled_back_everywhere():
    with tree(sub=2, inner=1, upper=2) as w:
        w.start()
        probe = w.register(level_and_pid)
        envelope = callreg._callreg.encode_envelope(pickle.dumps(NextLevelBomb()))
        with pytest.raises(callreg.RegisterError) as info:
            w.register_envelope(envelope)
        error = info.value
        assert error.code == "REGISTER_PARTIAL_FAILURE"
        assert error.hashid == callreg.hashid(envelope)
        assert sorted(error.outcomes) == [0, 1, 2, 3]
        for t in (0, 1):
            assert error.outcomes[t] == "rolled back"
        for t in (2, 3):
            assert error.outcomes[t].startswith("failed (DESERIALIZE_FAILED: ")
            assert "refused on a next-level target" in error.outcomes[t]
        assert installed(w) == {t: [probe.hashid] for t in range(4)}
        assert [h["hashid"] for h in w.inspect()["registry"]["handles"]] == [probe.hashid]
        # Still usable, both kinds.
        assert w.call(probe, target=0)[0] == "sub"
        assert w.call(probe, target=3)[0] == "next"


def test_a_next_level_child_dying_mid_register_leaves_no_install():
    with tree(sub=2, inner=1, upper=1, respawn_limit=0) as w:
        w.start()
        pids = w.register(tree_pids)
        pid, inner = w.call(pids, target=2)
        envelope = callreg._callreg.encode_envelope(pickle.dumps(NextLevelExit()))
        with pytest.raises(callreg.RegisterError) as info:
            w.register_envelope(envelope)
        error = info.value
        assert error.code == "REGISTER_PARTIAL_FAILURE"
        assert error.outcomes[2] == "lost (its reply socket closed; it exited with status 7)"
        assert error.outcomes[0] == error.outcomes[1] == "rolled back"
        assert w.targets == [0, 1]
        assert installed(w) == {0: [pids.hashid], 1: [pids.hashid]}
        assert w.inspect()["registry"]["digests"] == [{"hashid": pids.hashid, "live_handles": 1}]
        assert wait_until(lambda: not any(running(p) for p in inner.values()))
        assert not running(pid)
        square_h = w.register(square)
        assert w.call_all(square_h, 3) == {0: 9, 1: 9}
    assert shm_of([pid] + list(inner.values())) == []


def test_a_next_level_gives_its_inner_worker_every_option_it_was_given(monkeypatch, capfd):
    # The inner Worker is built in the next-level target; here its
    # constructor records what it was given and stops the build.
    given = {}

    class Recorded(Exception):
        pass

    def inner_worker(targets, **options):
        given.update(options, targets=targets)
        raise Recorded

    monkeypatch.setattr(callreg._worker, "Worker", inner_worker)
    level = callreg.NextLevel(3, spin=0, respawn_backoff=0.5, probe_first=False, slot_capacity=16)
    with pytest.raises(Recorded):
        callreg._tree._start_target(0, level, 0)
    assert "Recorded" in capfd.readouterr().err
    assert (given["targets"], given["spin"], given["respawn_backoff"]) == (3, 0, 0.5)
    assert (given["probe_first"], given["slot_capacity"]) == (False, 16)
    assert callreg.NextLevel(1).spin == callreg.Worker.__init__.__kwdefaults__["spin"]
    with pytest.raises(ValueError, match=r"^spin must be at most 0\.001 seconds, got 0\.002$"):
        callreg.NextLevel(1, spin=0.002)
