"""A closure over a large numpy array, through the package as users call
it, against ``ProcessPoolExecutor(mp_context=fork)`` (PPE) with an
initializer (the array inherited by ``fork``, the way a PPE program
shares it), measured in the same run, each system in turn per round.

* **memory**: ``Worker(N)`` started, a closure over the array registered
  and called on every target; the growth of the targets' summed PSS and
  private dirty memory (``/proc/PID/smaps_rollup``), with the array sent
  out of band (the default: every target maps it from one memory file,
  ``specs/formats.md`` §1.1) and in the pickle (``out_of_band=False``:
  every target unpickles its own copy); PPE(N)'s workers after a task
  each that reads the whole inherited array.
* **the realistic case**: start 2 workers, register the closure once
  (callreg), then ``--calls`` small reductions (the sum of 1,000 items
  each): one at a time (``call``; PPE ``submit().result()``) and as one
  ``map``. Wall time from before the pool is made to the last result,
  CPU time of every process (the parent and the workers or targets).

    python python/benchmarks/shared_buffers.py [--mb 50] [--targets 8] [--calls 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

import callreg

_DATA: Any = None


def _set_data(data: Any) -> None:
    global _DATA
    _DATA = data


def _reduce_inherited(i: int) -> float:
    """A PPE task: one small reduction of the inherited array."""
    start = (i * 1000) % (len(_DATA) - 1000)
    return float(_DATA[start : start + 1000].sum())


def _touch_inherited(_: int) -> float:
    return float(_DATA.sum())


def reducer(data: Any) -> Callable[[int], float]:
    """The callreg closure: the same reduction of the captured array."""

    def reduce(i: int) -> float:
        start = (i * 1000) % (len(data) - 1000)
        return float(data[start : start + 1000].sum())

    return reduce


def toucher(data: Any) -> Callable[[], float]:
    def touch() -> float:
        return float(data.sum())

    return touch


def _rollup(pid: int) -> dict[str, int]:
    found = {}
    with open("/proc/%d/smaps_rollup" % pid) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                found[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return found


def _cpu(pids: Iterable[int]) -> float:
    """CPU seconds (user + system) the live processes ``pids`` used."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _grown(before: dict[int, dict[str, int]], after: dict[int, dict[str, int]], key: str) -> int:
    return sum(after[pid][key] - before[pid][key] for pid in before)


def memory_callreg(data: Any, targets: int, out_of_band: bool) -> tuple[int, int]:
    with callreg.Worker(targets) as w:
        w.start()
        pids = [w.target_pid(t) for t in w.targets]
        before = {pid: _rollup(pid) for pid in pids}
        w.call_all(w.register(toucher(data), out_of_band=out_of_band))
        after = {pid: _rollup(pid) for pid in pids}
    return _grown(before, after, "Pss"), _grown(before, after, "Private_Dirty")


def memory_ppe(data: Any, workers: int) -> tuple[int, int]:
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=context, initializer=_set_data, initargs=(data,)
    ) as ex:
        # Every worker started and idle: one trivial task each, waited for.
        list(ex.map(abs, range(workers * 4)))
        pids = list(ex._processes)
        before = {pid: _rollup(pid) for pid in pids}
        list(ex.map(_touch_inherited, range(workers * 4), chunksize=1))
        after = {pid: _rollup(pid) for pid in pids}
    return _grown(before, after, "Pss"), _grown(before, after, "Private_Dirty")


def realistic_callreg(data: Any, calls: int, use_map: bool) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    with callreg.Worker(2) as w:
        w.start()
        h = w.register(reducer(data))
        if use_map:
            results = list(w.map(h, range(calls)))
        else:
            results = [w.call(h, i) for i in range(calls)]
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu + _cpu(w.target_pid(t) for t in w.targets)
    assert len(results) == calls
    return wall, cpu


def realistic_ppe(data: Any, calls: int, use_map: bool) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=context, initializer=_set_data, initargs=(data,)) as ex:
        if use_map:
            results = list(ex.map(_reduce_inherited, range(calls)))
        else:
            results = [ex.submit(_reduce_inherited, i).result() for i in range(calls)]
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu + _cpu(ex._processes)
    assert len(results) == calls
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=50, help="the array's size, MB (10^6 bytes)")
    parser.add_argument("--targets", type=int, default=8, help="targets (and PPE workers) of the memory scenario")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    data = np.random.default_rng(0).random(args.mb * 1_000_000 // 8)
    size = data.nbytes
    print(
        "array %.1f MB; load %.2f; %d rounds, medians" % (size / 1e6, os.getloadavg()[0], args.rounds),
        flush=True,
    )

    memory: dict[str, list[tuple[int, int]]] = {"shared": [], "copied": [], "ppe": []}
    realistic: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        memory["shared"].append(memory_callreg(data, args.targets, True))
        memory["copied"].append(memory_callreg(data, args.targets, False))
        memory["ppe"].append(memory_ppe(data, args.targets))
        for use_map in (False, True):
            kind = "map" if use_map else "one at a time"
            realistic.setdefault("callreg " + kind, []).append(realistic_callreg(data, args.calls, use_map))
            realistic.setdefault("PPE " + kind, []).append(realistic_ppe(data, args.calls, use_map))

    def med(rows: list[Any], i: int) -> float:
        return statistics.median(row[i] for row in rows)

    print()
    print(
        "| %d targets, closure over the array | PSS growth, all targets (× the array) | private dirty growth (× the array) |"
        % args.targets
    )
    print("|---|---:|---:|")
    for name, label in (
        ("shared", "callreg, out of band (default)"),
        ("copied", "callreg, `out_of_band=False`"),
        ("ppe", "PPE with an initializer (inherited)"),
    ):
        rows = memory[name]
        print(
            "| %s | %.1f MB (%.2f×) | %.1f MB (%.2f×) |"
            % (label, med(rows, 0) / 1e6, med(rows, 0) / size, med(rows, 1) / 1e6, med(rows, 1) / size)
        )
    print()
    print(
        "| 2 workers, %d reductions, from nothing to the last result | callreg wall (CPU) | PPE wall (CPU) | callreg / PPE: wall; CPU |"
        % args.calls
    )
    print("|---|---:|---:|---:|")
    for kind in ("one at a time", "map"):
        ours, peer = realistic["callreg " + kind], realistic["PPE " + kind]
        ratios_wall = [a[0] / b[0] for a, b in zip(ours, peer, strict=True)]
        ratios_cpu = [a[1] / b[1] for a, b in zip(ours, peer, strict=True)]
        print(
            "| %s | %.0f ms (%.0f ms) | %.0f ms (%.0f ms) | %.2f×; %.2f× |"
            % (
                kind,
                med(ours, 0) * 1e3,
                med(ours, 1) * 1e3,
                med(peer, 0) * 1e3,
                med(peer, 1) * 1e3,
                statistics.median(ratios_wall),
                statistics.median(ratios_cpu),
            )
        )


if __name__ == "__main__":
    main()
