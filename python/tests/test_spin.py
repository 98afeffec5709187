"""The spins (``specs/threads.md``, "The leader's spin" and "The target's
spin"): bounded, and never while nothing is waited for."""

import os
import time

import pytest
from conftest import nap

import callreg


def _cpu(pid):
    """CPU seconds (user + system) process ``pid`` used so far."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def echo(x):
    return x


def test_an_idle_worker_uses_no_cpu():
    with callreg.Worker(2) as w:
        w.start()
        h = w.register(echo)
        # Waits that spun and waits that did not, then nothing to wait for.
        assert [w.call(h, i) for i in range(200)] == list(range(200))
        pids = [w.target_pid(t) for t in w.targets]
        parent, targets = time.process_time(), sum(_cpu(pid) for pid in pids)
        time.sleep(1.0)
        parent, targets = time.process_time() - parent, sum(_cpu(pid) for pid in pids) - targets
        # Clock ticks are 10 ms: nothing, give or take one tick.
        assert parent < 0.02, parent
        assert targets < 0.02, targets


def test_a_wait_spins_for_its_budget_at_most():
    # Each reply comes 20 ms after its call: a caller spinning through the
    # wait would burn 20 ms of CPU per call; a spin of at most 1 ms burns
    # at most that.
    with callreg.Worker(1, spin=0.001) as w:
        w.start()
        h = w.register(nap)
        cpu = time.process_time()
        assert [w.call(h, 0.02) for _ in range(20)] == [0.02] * 20
        assert time.process_time() - cpu < 0.1


def test_a_target_spins_for_its_budget_at_most_after_each_task():
    # Each task comes 20 ms after the last: a task thread spinning through
    # the gap would burn 20 ms of CPU per task; a spin of at most 1 ms
    # burns at most that.
    with callreg.Worker(1, spin=0.001) as w:
        w.start()
        h = w.register(echo)
        pid = w.target_pid(0)
        cpu = _cpu(pid)
        for i in range(20):
            assert w.call(h, i) == i
            time.sleep(0.02)
        assert _cpu(pid) - cpu < 0.1


@pytest.mark.parametrize(
    ("spin", "error", "message"),
    [
        (0.002, ValueError, "spin must be at most 0.001 seconds, got 0.002"),
        (-1e-6, ValueError, "spin must be zero or positive, got -1e-6"),
        ("50us", TypeError, "spin must be a number of seconds, not str"),
    ],
)
def test_a_spin_out_of_bounds_is_refused(spin, error, message):
    with pytest.raises(error) as info:
        callreg.Worker(1, spin=spin)
    assert str(info.value) == message


@pytest.mark.parametrize("spin", [0.001, 0.001 + 4.75e-11, 0.001 + 4.9e-10])
def test_a_spin_that_rounds_to_the_bound_in_nanoseconds_is_the_bound(spin):
    # numpy.float32(1e-3) is 0.001 + 4.75e-11 seconds.
    with callreg.Worker(1, spin=spin) as w:
        w.start()
        assert w.call(w.register(echo), 1) == 1


@pytest.mark.parametrize("spin", [0.001 + 5.1e-10, 0.001 + 1e-9, float("inf")])
def test_a_spin_past_the_bound_by_half_a_nanosecond_is_refused(spin):
    with pytest.raises(ValueError) as info:
        callreg.Worker(1, spin=spin)
    assert str(info.value) == "spin must be at most 0.001 seconds, got %r" % spin


def test_a_worker_that_never_spins_serves_the_same():
    with callreg.Worker(1, spin=0) as w:
        w.start()
        assert w.call(w.register(echo), "same") == "same"
