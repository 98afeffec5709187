"""Every test ends with no staged payload held by this process (no open
descriptor of, and no mapping of, a callreg staging memfd) and no child
process left (running or zombie)."""

import gc
import os
import subprocess
import sys
import time

import pytest

# The name every staged payload's memfd has (src/io/staging.rs).
STAGED = "memfd:callreg-staged"


def nap(seconds):
    """A callable for targets: sleeps ``seconds``, returns them."""
    time.sleep(seconds)
    return seconds


def staged_left(pid="self"):
    """Descriptors and mappings of staged payloads process ``pid`` (this
    one by default) holds."""
    held = []
    for fd in os.listdir("/proc/%s/fd" % pid):
        try:
            link = os.readlink("/proc/%s/fd/%s" % (pid, fd))
        except OSError:
            continue  # closed meanwhile (e.g. the listing's own descriptor)
        if STAGED in link:
            held.append("fd %s -> %s" % (fd, link))
    with open("/proc/%s/maps" % pid) as maps:
        held.extend("mapped: " + line.strip() for line in maps if STAGED in line)
    return held


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
    assert staged_left() == []
    assert children() - before == set()


def pytest_collection_modifyitems(items):
    """callreg.dask's tests run last: distributed starts threads (its event
    loop, its offload pool) that live as long as this process, and earlier
    tests fork with no other thread running."""
    items.sort(key=lambda item: item.module.__name__.endswith("test_dask"))


def outputs_of(program):
    """{"ppe": stdout, "callreg": stdout} of ``program`` run as a script
    (``python -c``) with ``"ppe"`` and with ``"callreg"`` as its argument;
    each run must exit 0."""
    outputs = {}
    for kind in ("ppe", "callreg"):
        done = subprocess.run([sys.executable, "-c", program, kind], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        outputs[kind] = done.stdout
    return outputs
