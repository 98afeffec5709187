"""Peak memory and time of registering a large callable, through the
package as users call it: ``Worker.register(fn)`` (pickled once, straight
into the memory file the targets read) beside ``cloudpickle.dumps(fn)``
alone (the floor: one copy of the pickle) and beside
``register_envelope(pack(fn))`` (the pickle built in memory, then staged:
two copies), each measured in the same run.

Memory is sampled every 0.5 ms while the call runs: this process's
anonymous memory plus the machine's shared memory (``Shmem`` in
``/proc/meminfo``, where memory files live), above its level before the
call. CPU time is this process's (every thread), wall time the call's.

    python python/benchmarks/register_memory.py [--sizes 64,256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import cloudpickle

import callreg


def _field(path: str, name: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(name):
                return int(line.split()[1]) * 1024
    raise KeyError(name)


def _memory() -> int:
    return _field("/proc/self/status", "RssAnon:") + _field("/proc/meminfo", "Shmem:")


def measure(call: Callable[[], Any], done: Callable[[Any], object] = lambda _: None) -> tuple[int, float, float]:
    """(peak bytes above the start, wall seconds, CPU seconds) of
    ``call``; ``done`` is then given its result (not measured)."""
    peak = [0]
    stop = threading.Event()
    # What the last call left is freed in the background (an unregistered
    # payload's memory file): wait until memory is steady.
    base = _memory()
    for _ in range(100):
        time.sleep(0.02)
        base, last = _memory(), base
        if abs(base - last) < (1 << 20):
            break

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _memory())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    wall, cpu = time.perf_counter(), time.process_time()
    result = call()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    # The sampler cannot run while a call holds the interpreter lock (a
    # pickle's copy does): what the call returns counts too.
    peak[0] = max(peak[0], _memory())
    stop.set()
    sampler.join()
    done(result)
    return peak[0] - base, wall, cpu


def _closure_over(data: bytes) -> Callable[[], int]:
    def fn() -> int:
        return len(data)

    return fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,256", help="captured bytes per callable, MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        "| captured | dumps: peak, wall, CPU | register(fn): peak, wall, CPU (ratio to dumps) | register_envelope(pack(fn)): peak (ratio) |"
    )
    print("|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        fn = _closure_over(os.urandom(size << 20))

        floors, registers, packed = [], [], []
        with callreg.Worker(1) as worker:
            worker.start()
            for _ in range(args.rounds):
                floors.append(measure(lambda fn=fn: cloudpickle.dumps(fn)))
                registers.append(measure(lambda fn=fn: worker.register(fn), worker.unregister))
                packed.append(measure(lambda fn=fn: worker.register_envelope(callreg.pack(fn)), worker.unregister))

        def med(rows: list[tuple[int, float, float]], i: int) -> float:
            return statistics.median(row[i] for row in rows)

        mib = 1 << 20
        print(
            "| %d MiB | %.0f MiB, %.0f ms, %.0f ms | %.0f MiB (%.2f×), %.0f ms (%.2f×), %.0f ms (%.2f×) | %.0f MiB (%.2f×) |"
            % (
                size,
                med(floors, 0) / mib,
                med(floors, 1) * 1e3,
                med(floors, 2) * 1e3,
                med(registers, 0) / mib,
                med(registers, 0) / med(floors, 0),
                med(registers, 1) * 1e3,
                med(registers, 1) / med(floors, 1),
                med(registers, 2) * 1e3,
                med(registers, 2) / med(floors, 2),
                med(packed, 0) / mib,
                med(packed, 0) / med(floors, 0),
            )
        )


if __name__ == "__main__":
    main()
