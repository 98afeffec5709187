"""Round trip through the package as users call it (``Worker.call`` of a
registered identity function, one target) beside a pipe echo between two
Python processes (the floor: one write and one read each way), with the
leader's spin at its default and off, measured in the same round, each
round interleaving the three; quiet, and again with ``--load N`` busy
processes (pure Python loops) running meanwhile.

Wall time per call, and CPU per call of every process involved (the
caller and its target, or both echo processes). Each round's figures are
ratios to that round's echo; the medians of the rounds are printed.

    python python/benchmarks/round_trip.py [--calls 20000] [--rounds 7] [--load 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable

import callreg

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def echo(calls: int) -> tuple[float, float]:
    """(wall, CPU) seconds per round trip of a one-byte pipe echo."""
    there, here = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(there[1])
        os.close(here[0])
        while True:
            byte = os.read(there[0], 1)
            if not byte:
                os._exit(0)
            os.write(here[1], byte)
    os.close(there[0])
    os.close(here[1])
    wall, cpu, child = time.perf_counter(), time.process_time(), _cpu(pid)
    for _ in range(calls):
        os.write(there[1], b"x")
        os.read(here[0], 1)
    wall, cpu, child = time.perf_counter() - wall, time.process_time() - cpu, _cpu(pid) - child
    os.close(there[1])
    os.waitpid(pid, 0)
    os.close(here[0])
    return wall / calls, (cpu + child) / calls


def identity(x: int) -> int:
    return x


def calls_of(worker: callreg.Worker, calls: int) -> tuple[float, float]:
    """(wall, CPU) seconds per ``call`` of an identity function."""
    h = worker.register(identity)
    for i in range(100):
        worker.call(h, i)
    pid = worker.target_pid(0)
    wall, cpu, target = time.perf_counter(), time.process_time(), _cpu(pid)
    for i in range(calls):
        worker.call(h, i)
    wall, cpu, target = time.perf_counter() - wall, time.process_time() - cpu, _cpu(pid) - target
    return wall / calls, (cpu + target) / calls


def _busy() -> None:
    while True:
        pass


def run(label: str, rounds: int, calls: int) -> None:
    rows: dict[str, list[tuple[float, float]]] = {"echo": [], "default": [], "off": []}
    with callreg.Worker(1) as spinning, callreg.Worker(1, spin=0) as blocking:
        spinning.start()
        blocking.start()
        for _ in range(rounds):
            rows["echo"].append(echo(calls))
            rows["default"].append(calls_of(spinning, calls))
            rows["off"].append(calls_of(blocking, calls))

    def ratio(name: str, i: int) -> float:
        return statistics.median(a[i] / b[i] for a, b in zip(rows[name], rows["echo"], strict=True))

    def med(name: str, i: int) -> float:
        return statistics.median(row[i] for row in rows[name]) * 1e6

    print("\n%s (load average %.2f at the end)" % (label, os.getloadavg()[0]))
    print("| round trip | wall per call | CPU per call (all processes) | wall / echo | CPU / echo |")
    print("|---|---:|---:|---:|---:|")
    print("| pipe echo (floor) | %.1f µs | %.1f µs | 1 | 1 |" % (med("echo", 0), med("echo", 1)))
    for name, what in (("default", "`call`, spin 50 µs (default)"), ("off", "`call`, `spin=0`")):
        print(
            "| %s | %.1f µs | %.1f µs | %.2f | %.2f |"
            % (what, med(name, 0), med(name, 1), ratio(name, 0), ratio(name, 1))
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--load", type=int, default=2, help="busy processes of the loaded run (0: no loaded run)")
    args = parser.parse_args()
    run("quiet", args.rounds, args.calls)
    if args.load:
        context = multiprocessing.get_context("fork")
        busy: list[Callable[[], None]] = []
        processes = [context.Process(target=_busy, daemon=True) for _ in range(args.load)]
        for process in processes:
            process.start()
            busy.append(process.kill)
        try:
            run("loaded: %d busy processes" % args.load, args.rounds, args.calls)
        finally:
            for kill in busy:
                kill()
            for process in processes:
                process.join()


if __name__ == "__main__":
    main()
