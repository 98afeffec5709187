"""Every test ends with no staged payload of this process in /dev/shm and
no child process left (running or zombie)."""

import gc
import os

import pytest


def shm_left():
    prefix = "callreg-%d-" % os.getpid()
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix))


def children():
    """Child pids of this process (any thread), zombies included."""
    pids = set()
    base = "/proc/%d/task" % os.getpid()
    for task in os.listdir(base):
        try:
            with open("%s/%s/children" % (base, task)) as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return pids


@pytest.fixture(autouse=True)
def nothing_left():
    before = children()
    yield
    gc.collect()
    assert shm_left() == []
    assert children() - before == set()
