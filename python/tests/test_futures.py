"""Futures of Worker.submit: every way to wait resolves them exactly once
(inline waiters, done-callbacks, concurrent.futures.wait and
as_completed, asyncio), and the package's one-copy pack and version
checks."""

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc

import cloudpickle
import pytest

import callreg


def square(x):
    return x * x


def slow_square(x, seconds):
    time.sleep(seconds)
    return x * x


def fail(x):
    raise ZeroDivisionError("no %d" % x)


@pytest.fixture(scope="module")
def worker():
    with callreg.Worker(2) as w:
        w.start()
        yield w


def square_once_started(x, started):
    """Writes ``started``, then returns ``x * x`` a moment later."""
    with open(started, "w") as f:
        f.write("started")
    time.sleep(0.2)
    return x * x


def test_a_future_is_a_running_concurrent_future(worker, tmp_path):
    h = worker.register(square_once_started)
    started = tmp_path / "started"
    future = worker.submit(h, 9, str(started))
    assert isinstance(future, concurrent.futures.Future)
    assert future.running() or future.done()
    # Once its task runs, it cannot be cancelled (a loaded machine may
    # start it late; before it starts it could be).
    deadline = time.monotonic() + 10
    while not started.exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert future.cancel() is False
    assert future.result(timeout=10) == 81
    assert future.done() and not future.running()
    assert future.exception() is None
    worker.unregister(h)


def test_done_polls_the_result_without_a_wait(worker):
    h = worker.register(square)
    future = worker.submit(h, 4)
    deadline = time.monotonic() + 10
    while not future.done():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert future.result(timeout=0) == 16
    worker.unregister(h)


def test_done_callbacks_run_once_each_with_nobody_waiting(worker):
    h = worker.register(square)
    seen = []
    lock = threading.Lock()
    every = threading.Event()

    def record(future):
        with lock:
            seen.append(future.result())
            if len(seen) == 50:
                every.set()

    futures = [worker.submit(h, i) for i in range(50)]
    for future in futures:
        future.add_done_callback(record)
    assert every.wait(10)
    assert sorted(seen) == sorted(i * i for i in range(50))
    # A callback added once done runs at once, in this thread.
    here = []
    futures[0].add_done_callback(lambda f: here.append(threading.current_thread()))
    assert here == [threading.current_thread()]
    worker.unregister(h)


def test_wait_and_as_completed_see_every_result(worker):
    h = worker.register(slow_square)
    futures = [worker.submit(h, i, 0.01 * (i % 3)) for i in range(12)]
    done, not_done = concurrent.futures.wait(futures, timeout=10)
    assert (len(done), not_done) == (12, set())
    assert [f.result() for f in futures] == [i * i for i in range(12)]
    futures = [worker.submit(h, i, 0.01 * (i % 3)) for i in range(12)]
    assert sorted(f.result() for f in concurrent.futures.as_completed(futures, timeout=10)) == sorted(
        i * i for i in range(12)
    )
    first = worker.submit(h, 2, 1.0, target=0)
    quick = worker.submit(h, 3, 0.0, target=1)
    done, _ = concurrent.futures.wait([first, quick], timeout=10, return_when=concurrent.futures.FIRST_COMPLETED)
    assert quick in done
    assert first.result(timeout=10) == 4
    worker.unregister(h)


def test_a_timed_out_wait_keeps_the_future(worker):
    h = worker.register(slow_square)
    future = worker.submit(h, 5, 0.5)
    with pytest.raises(concurrent.futures.TimeoutError):
        future.result(timeout=0.01)
    assert future.result(timeout=10) == 25
    future = worker.submit(h, 6, 0.3)
    with pytest.raises(concurrent.futures.TimeoutError):
        future.exception(timeout=0)
    assert future.exception(timeout=10) is None
    assert future.result() == 36
    worker.unregister(h)


def test_many_threads_wait_on_one_future(worker):
    h = worker.register(slow_square)
    future = worker.submit(h, 7, 0.2)
    results = []

    def wait():
        results.append(future.result(timeout=10))

    threads = [threading.Thread(target=wait) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert results == [49] * 6
    worker.unregister(h)


def test_a_task_error_reaches_every_way_of_waiting(worker):
    h = worker.register(fail)
    future = worker.submit(h, 3)
    error = future.exception(timeout=10)
    assert type(error) is ZeroDivisionError
    assert error.__cause__.remote_type == "ZeroDivisionError"
    with pytest.raises(ZeroDivisionError, match="no 3") as raised:
        future.result()
    assert raised.value is error
    called = threading.Event()
    other = worker.submit(h, 4)
    other.add_done_callback(lambda f: called.set())
    assert called.wait(10)
    assert isinstance(other.exception(), ZeroDivisionError)
    worker.unregister(h)


def test_asyncio_awaits_a_future(worker):
    h = worker.register(square)

    async def main():
        return await asyncio.gather(*(asyncio.wrap_future(worker.submit(h, i)) for i in range(20)))

    assert asyncio.run(main()) == [i * i for i in range(20)]
    worker.unregister(h)


def test_a_callback_may_wait_on_another_future_of_the_worker(worker):
    h = worker.register(square)
    later = worker.submit(h, 12)
    seen = []
    done = threading.Event()

    def chain(future):
        seen.append(future.result() + later.result(timeout=10))
        done.set()

    worker.submit(h, 2).add_done_callback(chain)
    assert done.wait(10)
    assert seen == [148]
    worker.unregister(h)


def test_pending_futures_fail_at_close():
    w = callreg.Worker(1)
    w.start()
    h = w.register(slow_square)
    waited = w.submit(h, 1, 30)
    armed = w.submit(h, 2, 30)
    called = threading.Event()
    armed.add_done_callback(lambda f: called.set())
    time.sleep(0.1)
    w.close()
    assert called.wait(10)
    for future in (waited, armed):
        assert type(future.exception(timeout=10)) is callreg.LifecycleError
    after = w.submit(h, 3)
    assert type(after.exception(timeout=10)) is callreg.LifecycleError


def test_pack_pickles_straight_into_the_envelope():
    blob = os.urandom(16 * 1024 * 1024)

    def closure():
        return len(blob)

    envelope = callreg.pack(closure)
    assert envelope[16:] == cloudpickle.dumps(closure, protocol=5)
    assert callreg.hashid(envelope) == callreg.hashid(closure)
    del envelope
    tracemalloc.start()
    try:
        envelope = callreg.pack(closure)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # One buffer (and its growth slack), never a second copy of it.
    assert len(envelope) > len(blob)
    assert peak < 1.3 * len(envelope), (peak, len(envelope))


def _memory():
    """This process's anonymous memory plus the machine's shared memory
    (where memory files live), in bytes."""
    total = 0
    for path, name in (("/proc/self/status", "RssAnon:"), ("/proc/meminfo", "Shmem:")):
        with open(path) as f:
            total += next(int(line.split()[1]) for line in f if line.startswith(name)) * 1024
    return total


def test_a_large_register_pickles_once_into_the_memory_file_the_targets_read():
    blob = os.urandom(96 * 1024 * 1024)

    def closure():
        return len(blob)

    with callreg.Worker(1) as w:
        w.start()
        # The bytes path for comparison: the pickle in memory, then staged.
        h = w.register_envelope(callreg.pack(closure))
        assert h.hashid == callreg.hashid(closure)
        w.unregister(h)
        del h
        time.sleep(0.5)  # the unregistered payload's memory file is freed
        peak = [0]
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _memory())
                time.sleep(0.0005)

        base = _memory()
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            h = w.register(closure)
        finally:
            stop.set()
            sampler.join()
        assert h.hashid == callreg.hashid(closure)
        assert w.call(h) == len(blob)
        # One copy of the pickle (the memory file), never two (the bytes
        # path's 2x); the margin covers the sampling of a shared machine.
        assert peak[0] - base < 1.5 * len(blob), (peak[0] - base, len(blob))


def test_a_register_without_memory_for_its_pickle_raises_memory_error(tmp_path):
    # A file size limit makes writing the memory file fail (EFBIG, as a
    # full memory would with ENOMEM or ENOSPC); the Worker stays usable.
    script = tmp_path / "limited.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, resource, callreg
            blob = os.urandom(32 * 1024 * 1024)
            small = os.urandom(20000)
            with callreg.Worker(1) as w:
                w.start()
                resource.setrlimit(resource.RLIMIT_FSIZE, (8 * 1024 * 1024, resource.RLIM_INFINITY))
                try:
                    w.register(lambda: len(blob))
                except MemoryError as e:
                    print("MemoryError:", e)
                # Small pickles are staged from memory: the same error.
                resource.setrlimit(resource.RLIMIT_FSIZE, (10000, resource.RLIM_INFINITY))
                for register in (w.register, lambda f: w.register_envelope(callreg.pack(f))):
                    try:
                        register(lambda: len(small))
                    except MemoryError as e:
                        print("MemoryError:", str(e).split(":")[0])
                resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                print(w.call(w.register(lambda: 7)))
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "MemoryError: no memory to stage the callable's pickle: [Errno 27] File too large",
        "MemoryError: no memory to stage the callable's pickle",
        "MemoryError: no memory to stage the callable's pickle",
        "7",
    ]


def count_metadata_lookups():
    """Run in a target: makes every distribution-metadata lookup count."""
    import importlib.metadata

    global LOOKUPS
    LOOKUPS = 0
    real = importlib.metadata.version

    def counted(name):
        global LOOKUPS
        LOOKUPS += 1
        return real(name)

    importlib.metadata.version = counted
    return True


def lookups():
    return LOOKUPS


def test_an_install_reads_no_distribution_metadata():
    with callreg.Worker(2) as w:
        w.start()
        counting = w.register(count_metadata_lookups)
        assert w.call_all(counting) == {0: True, 1: True}
        read = w.register(lookups)
        # Default metadata: the interpreter's and cloudpickle's versions
        # are checked at every install, from what the target read at start.
        for i in range(5):
            h = w.register(lambda i=i: i)
            assert w.call_all(h) == {0: i, 1: i}
            w.unregister(h)
        assert w.call_all(read) == {0: 0, 1: 0}


def test_a_callback_may_wait_on_another_armed_future(worker):
    h = worker.register(slow_square)
    later = worker.submit(h, 5, 0.2)
    later.add_done_callback(lambda f: None)  # armed: the dispatcher resolves it
    seen = []
    done = threading.Event()

    def chain(future):
        seen.append(future.result() + later.result(timeout=10))
        done.set()

    first = worker.submit(h, 2, 0.0)
    first.add_done_callback(chain)
    assert done.wait(10)
    assert seen == [29]
    # The dispatcher goes on with the rest.
    flag = threading.Event()
    worker.submit(h, 1, 0.0).add_done_callback(lambda f: flag.set())
    assert flag.wait(10)
    worker.unregister(h)


def test_a_target_out_of_range_is_a_value_error(worker):
    h = worker.register(square)
    for attempt in (
        lambda: worker.submit(h, 1, target=2),
        lambda: worker.call(h, 1, target=-1),
        lambda: worker.target_pid(5),
        lambda: worker.target_phase(2),
        lambda: worker.target_incarnation(9),
    ):
        with pytest.raises(ValueError, match=r"target must be in 0\.\.1 \(the Worker's 2 target ids\), got "):
            attempt()
    with pytest.raises(TypeError, match="target must be an int or None, not str"):
        worker.call(h, 1, target="0")
    worker.unregister(h)


def test_an_argument_over_max_frame_bytes_names_the_option():
    with callreg.Worker(1, max_frame_bytes=4096) as w:
        w.start()
        h = w.register(square)
        for attempt in (lambda: w.call(h, b"x" * 10000), lambda: w.submit(h, b"x" * 10000).result(timeout=10)):
            with pytest.raises(callreg.CallregError) as info:
                attempt()
            assert info.value.code == "FRAME_INVALID"
            assert "bytes, over the maximum of 4096 (max_frame_bytes)" in str(info.value)
        assert w.call(h, 3) == 9


def test_a_result_timeout_is_counted_once(worker):
    h = worker.register(slow_square)
    future = worker.submit(h, 2, 3.0)
    began = time.monotonic()
    with pytest.raises(concurrent.futures.TimeoutError):
        future.result(timeout=0.5)
    # One timeout, not one for the inline wait and another after it.
    assert time.monotonic() - began < 0.95
    assert future.result(timeout=10) == 4
    worker.unregister(h)


def test_waiters_and_a_poller_of_one_future_all_see_its_result(worker):
    h = worker.register(slow_square)
    future = worker.submit(h, 3, 0.3)
    seen = []
    stop = threading.Event()

    def poll():
        while not future.done() and not stop.is_set():
            pass
        seen.append("polled")

    def wait():
        seen.append(future.result(timeout=10))

    threads = [threading.Thread(target=poll)] + [threading.Thread(target=wait) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    stop.set()
    assert sorted(seen, key=str) == [9, 9, 9, "polled"]
    worker.unregister(h)


def test_a_future_waited_on_by_its_submitter_alone_makes_no_condition(worker, monkeypatch):
    # The future's own waiter resolves it without the Condition, waiter
    # list or callback list of concurrent.futures (about 2 µs a task);
    # whoever looks at it later gets them and sees it finished.
    h = worker.register(square)
    made = []
    real = threading.Condition

    def counted(*args):
        made.append(1)
        return real(*args)

    monkeypatch.setattr(threading, "Condition", counted)
    futures = [worker.submit(h, i) for i in range(50)]
    assert [f.result() for f in futures] == [i * i for i in range(50)]
    assert made == []
    called = []
    futures[0].add_done_callback(lambda f: called.append(f.result()))
    assert called == [0]
    done, not_done = concurrent.futures.wait(futures, timeout=5)
    assert (len(done), not_done) == (50, set())
    assert sorted(f.result() for f in concurrent.futures.as_completed(futures, timeout=5)) == sorted(
        i * i for i in range(50)
    )
    assert repr(futures[1]).endswith("state=finished returned int>")
    worker.unregister(h)


def test_a_wait_that_starts_while_the_submitter_resolves_still_ends(worker):
    # concurrent.futures.wait in other threads, started at every moment of
    # the submitter's own wait and resolution: each sees the future done,
    # through its state or its notification (none waits out its timeout).
    h = worker.register(slow_square)
    for delay in (0.0, 0.001, 0.002, 0.005, 0.01):
        futures = [worker.submit(h, i, delay) for i in range(20)]
        ended = []

        def watch(future, ended=ended):
            done, _ = concurrent.futures.wait([future], timeout=10)
            ended.append(len(done))

        threads = [threading.Thread(target=watch, args=(f,)) for f in futures]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        assert [f.result() for f in futures] == [i * i for i in range(20)]
        for thread in threads:
            thread.join(20)
        assert ended == [1] * 20
        assert time.monotonic() - start < 9
    worker.unregister(h)


def test_a_callback_waits_on_a_future_whose_result_came_in_the_same_batch(worker):
    # Both results reach the dispatcher together: a's callback waits on b,
    # whose result is in the batch being served, not in the channel.
    h = worker.register(slow_square)
    for _ in range(5):
        a = worker.submit(h, 2, 0.05, target=0)
        b = worker.submit(h, 3, 0.05, target=1)
        time.sleep(0.3)  # both done in their targets, neither read yet
        got = []
        a.add_done_callback(lambda f, got=got, b=b: got.append((f.result(), b.result(timeout=5))))
        b.add_done_callback(lambda f: None)
        start = time.monotonic()
        concurrent.futures.wait([a, b], timeout=10)
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [(4, 9)]
        assert time.monotonic() - start < 4
    worker.unregister(h)
