"""Tasks in flight through the package as users call it, against the
crate's Rust API over the same kind of target (a Python target running an
identity function), in the same rounds: the package submits 100 tasks
(``Worker.submit``) then waits for each result, again and again; the Rust
API's figure is the ``in_flight/100/1`` scenario of ``benches/floors.rs``
(``--python``: 100 ``submit_async`` on one target, then each waited for),
run as a child process once per round, between the package's
measurements. Also per round: ``submit().result()`` and ``call`` one at a
time (their difference is the future's own cost), and the package's CPU
per task in flight.

Build the Rust side first (``cargo bench --no-run --features io,python
--bench floors``; the path it prints is ``--floors``); ``PYO3_PYTHON``
is set to this interpreter for it.

    python python/benchmarks/in_flight.py --floors target/release/deps/floors-HASH [--rounds 7] [--tasks 20000]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import callreg


def identity(x: int) -> int:
    return x


def rust_rate(floors: str) -> float:
    """Tasks per second of the Rust API, 100 in flight on 1 Python target."""
    env = dict(os.environ, PYO3_PYTHON=sys.executable)
    out = subprocess.run(
        [floors, "--python", "--rounds", "1", "in_flight/100/1"], env=env, check=True, capture_output=True, text=True
    ).stdout
    found = re.search(r"^\| in_flight/100/1 \| (\d+) tasks/s \|", out, re.MULTILINE)
    if found is None:
        raise SystemExit("no in_flight/100/1 row in the floors output:\n" + out)
    return float(found.group(1))


def package_rate(worker: callreg.Worker, h: callreg.Handle[[int], int], tasks: int) -> tuple[float, float]:
    """(tasks per second, this process's CPU seconds per task), 100 in flight."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(tasks // 100):
        futures = [worker.submit(h, 7) for _ in range(100)]
        for future in futures:
            future.result()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return tasks / wall, cpu / tasks


def one_at_a_time(worker: callreg.Worker, h: callreg.Handle[[int], int], calls: int) -> tuple[float, float]:
    """(seconds per ``call``, seconds per ``submit().result()``)."""
    start = time.perf_counter()
    for i in range(calls):
        worker.call(h, i)
    middle = time.perf_counter()
    for i in range(calls):
        worker.submit(h, i).result()
    end = time.perf_counter()
    return (middle - start) / calls, (end - middle) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--floors", required=True, help="the built benches/floors.rs binary")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tasks", type=int, default=20000)
    args = parser.parse_args()
    rows = []
    with callreg.Worker(1) as w:
        w.start()
        h = w.register(identity)
        package_rate(w, h, 2000)
        for _ in range(args.rounds):
            rust = rust_rate(args.floors)
            rate, cpu = package_rate(w, h, args.tasks)
            call, submit = one_at_a_time(w, h, args.tasks // 4)
            rows.append((rust, rate, cpu, call, submit))
    print("load average %.2f at the end; %d rounds, medians" % (os.getloadavg()[0], args.rounds))
    print("| 100 in flight, 1 target | rate | package / Rust API (same round) |")
    print("|---|---:|---:|")
    print("| Rust API (`submit_async`) | %.0f tasks/s | |" % statistics.median(r[0] for r in rows))
    print(
        "| package (`Worker.submit`, then `result()`) | %.0f tasks/s (%.1f µs CPU per task) | %.2f |"
        % (
            statistics.median(r[1] for r in rows),
            statistics.median(r[2] for r in rows) * 1e6,
            statistics.median(r[1] / r[0] for r in rows),
        )
    )
    print(
        "one at a time: `call` %.1f µs, `submit().result()` %.1f µs (difference %.1f µs)"
        % (
            statistics.median(r[3] for r in rows) * 1e6,
            statistics.median(r[4] for r in rows) * 1e6,
            statistics.median(r[4] - r[3] for r in rows) * 1e6,
        )
    )


if __name__ == "__main__":
    main()
