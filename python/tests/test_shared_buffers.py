"""Large buffers a callable captures go out of band (``specs/formats.md``
§1.1): every target maps them read-only from one sealed memory file."""

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


def writer_into(buffer):
    def write():
        try:
            memoryview(buffer).cast("B")[0] = 1
        except TypeError as failure:
            return "refused: %s" % failure
        return "written"

    return write


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


def test_targets_share_the_buffer_pages_read_only_until_unregistered():
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
        write = w.register(writer_into(pickle.PickleBuffer(data)))
        assert w.call(write) == "refused: cannot modify read-only memory"
        w.unregister(write)
        # The last callable that refers to the file gone, no target maps it.
        w.unregister(h)
        assert [staged_mappings(w.target_pid(t))[0] for t in (0, 1)] == [{}, {}]


def test_a_buffer_of_a_callable_registered_before_start_is_a_read_only_copy():
    data = bytearray(os.urandom(2 * MIB))
    expected = closure_over(data)(1000)
    with callreg.Worker(2) as w:
        h = w.register(closure_over(pickle.PickleBuffer(data)))
        write = w.register(writer_into(pickle.PickleBuffer(data)))
        w.start()
        assert w.call_all(h, 1000) == {0: expected, 1: expected}
        assert w.call(write) == "refused: cannot modify read-only memory"


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


def test_a_numpy_array_is_shared_and_read_only_in_targets():
    np = pytest.importorskip("numpy")
    array = np.arange(MIB, dtype=np.float64)

    def total():
        return float(array.sum())

    def write():
        try:
            array[0] = 1.0
        except ValueError as failure:
            return str(failure)
        return "written"

    with callreg.Worker(2) as w:
        w.start()
        assert w.call_all(w.register(total)) == {0: float(array.sum()), 1: float(array.sum())}
        assert w.call(w.register(write)) == "assignment destination is read-only"
        assert [len(staged_mappings(w.target_pid(t))[0]) for t in (0, 1)] == [2, 2]
