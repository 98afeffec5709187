"""Large buffers a callable captures go out of band (``specs/formats.md``
§1.1): every target maps them copy-on-write from one sealed memory file."""

import os
import pickle
import signal
import time

import cloudpickle
import pytest

import callreg

MIB = 1 << 20
STAGED = "memfd:callreg-staged"


def closure_over(buffer):
    def checksum(step):
        view = memoryview(buffer).cast("B")
        return sum(view[::step]) + len(view)

    return checksum


def poker_into(buffer):
    def poke(i, value):
        """Writes ``value`` at byte ``i`` and returns what was there."""
        view = memoryview(buffer).cast("B")
        old = view[i]
        view[i] = value
        return old

    return poke


def staged_mappings(pid):
    """{inode: total kB mapped} of the staged memory files `pid` maps, and
    their private dirty kB, from /proc/PID/smaps."""
    mapped, private_dirty = {}, 0
    current = None
    with open("/proc/%d/smaps" % pid) as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                current = int(fields[4]) if STAGED in line else None
            elif current is not None and fields[0] == "Size:":
                mapped[current] = mapped.get(current, 0) + int(fields[1])
            elif current is not None and fields[0] in ("Private_Dirty:",):
                private_dirty += int(fields[1])
    return mapped, private_dirty


def test_a_large_buffer_goes_out_of_band_and_a_small_one_stays_in_the_pickle():
    big = pickle.PickleBuffer(bytearray(range(256)) * (4 * MIB // 256))
    fn = closure_over(big)
    envelope = callreg.pack(fn)
    assert envelope[:6] == b"SPYC\x81\x01"
    assert len(envelope) > 4 * MIB
    # Without out-of-band buffers: the reference form, cloudpickle's bytes.
    plain = callreg.pack(fn, out_of_band=False)
    assert plain[4] == 1
    assert plain[16:] == cloudpickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
    assert callreg.hashid(plain) != callreg.hashid(envelope) == callreg.hashid(fn)
    assert callreg.hashid(fn, out_of_band=False) == callreg.hashid(plain)
    # A buffer under the bound stays in the pickle: version 1, the bytes
    # cloudpickle gives.
    small = closure_over(pickle.PickleBuffer(bytearray(callreg.OUT_OF_BAND_MIN_BYTES - 1)))
    assert callreg.pack(small)[16:] == cloudpickle.dumps(small, protocol=pickle.HIGHEST_PROTOCOL)
    assert callreg.pack(small)[4] == 1


def test_targets_share_the_buffer_pages_until_unregistered():
    data = bytearray(os.urandom(8 * MIB))
    expected = closure_over(data)(4096)
    fn = closure_over(pickle.PickleBuffer(data))
    with callreg.Worker(2) as w:
        w.start()
        h = w.register(fn)
        # Hashed by the writer as it wrote (not read back): the digest of
        # the envelope pack() makes.
        assert h.hashid == callreg.hashid(fn) == callreg.hashid(callreg.pack(fn))
        assert w.call_all(h, 4096) == {0: expected, 1: expected}
        maps = [staged_mappings(w.target_pid(t)) for t in (0, 1)]
        # One mapping of the same file (inode) in both targets, of the whole
        # envelope; none of its pages is a private copy (a copy would be
        # 8192 kB of private dirty pages in each). The kernel counts a page
        # as private while only one process maps it, which memory
        # management (reclaim, page migration) may briefly make so for a
        # page or two of a loaded machine: at most 16 pages (64 kB) here.
        assert len(maps[0][0]) == len(maps[1][0]) == 1
        assert maps[0][0] == maps[1][0]
        assert list(maps[0][0].values())[0] * 1024 >= 8 * MIB
        assert maps[0][1] <= 64 and maps[1][1] <= 64, (maps[0][1], maps[1][1])
        poke = w.register(poker_into(pickle.PickleBuffer(data)))
        assert w.call(poke, 0, data[0] ^ 1, target=0) == data[0]
        w.unregister(poke)
        # The last callable that refers to the file gone, no target maps it.
        w.unregister(h)
        assert [staged_mappings(w.target_pid(t))[0] for t in (0, 1)] == [{}, {}]


def test_a_buffer_of_a_callable_registered_before_start_is_a_writable_copy():
    data = bytearray(os.urandom(2 * MIB))
    expected = closure_over(data)(1000)
    with callreg.Worker(2) as w:
        h = w.register(closure_over(pickle.PickleBuffer(data)))
        poke = w.register(poker_into(pickle.PickleBuffer(data)))
        w.start()
        assert w.call_all(h, 1000) == {0: expected, 1: expected}
        assert w.call(poke, 5, 0, target=0) == data[5]
        assert w.call(poke, 5, 1, target=0) == 0
        assert w.call(poke, 5, 1, target=1) == data[5]


def test_writes_stay_in_their_target_and_unwritten_pages_stay_shared():
    data = bytearray(os.urandom(8 * MIB))
    at = 3 * MIB + 17
    with callreg.Worker(4, respawn_backoff=0.01) as w:
        w.start()
        poke = w.register(poker_into(pickle.PickleBuffer(data)))
        # Targets 0 and 1 write; each sees its own write, nobody else's.
        assert w.call(poke, at, 7, target=0) == data[at]
        assert w.call(poke, at, 9, target=1) == data[at]
        assert w.call(poke, at, 8, target=0) == 7
        assert w.call(poke, at, 10, target=1) == 9
        # A third target reads the original.
        assert w.call(poke, at, data[at], target=2) == data[at]
        # One page written in each writer: the rest of the mapping is
        # shared (4 kB per written page, at most 64 kB of noise).
        dirty = [staged_mappings(w.target_pid(t))[1] for t in range(4)]
        assert all(d <= 64 + 8 for d in dirty), dirty
        # A later registration of the same callable, once the first is
        # gone, maps the file afresh in a writer: the original.
        w.unregister(poke)
        poke = w.register(poker_into(pickle.PickleBuffer(data)))
        assert w.call(poke, at, 7, target=0) == data[at]
        # A replacement of a writer starts from the file, unwritten.
        victim = w.target_pid(0)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while w.target_state(0) != ("joined", 1):
            assert time.monotonic() < deadline, w.target_events()
            time.sleep(0.005)
        assert w.call(poke, at, 1, target=0) == data[at]


def test_a_replacement_maps_the_buffers_of_the_callables_it_is_given():
    data = bytearray(os.urandom(3 * MIB))
    expected = closure_over(data)(999)
    with callreg.Worker(1) as w:
        w.start()
        h = w.register(closure_over(pickle.PickleBuffer(data)))
        os.kill(w.target_pid(0), signal.SIGKILL)
        deadline = time.monotonic() + 20
        while w.target_state(0) != ("joined", 1):
            assert time.monotonic() < deadline, w.target_events()
            time.sleep(0.005)
        assert w.call(h, 999) == expected
        assert len(staged_mappings(w.target_pid(0))[0]) == 1


def test_a_numpy_array_is_shared_and_writable_copy_on_write_in_targets():
    np = pytest.importorskip("numpy")
    array = np.arange(MIB, dtype=np.float64)

    def total():
        return float(array.sum())

    def write():
        array[0] += 1.0
        return float(array[0])

    with callreg.Worker(2) as w:
        w.start()
        assert w.call_all(w.register(total)) == {0: float(array.sum()), 1: float(array.sum())}
        h = w.register(write)
        assert [w.call(h, target=0), w.call(h, target=0), w.call(h, target=1)] == [1.0, 2.0, 1.0]
        assert [len(staged_mappings(w.target_pid(t))[0]) for t in (0, 1)] == [2, 2]
