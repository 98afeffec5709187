"""The package as users call it against the crate's Rust API over the
same kind of target (Python targets), in the same rounds. The Rust API's
figures are scenarios of ``benches/floors.rs --python``, run as a child
process once per round between the package's measurements:

* tasks in flight: the package submits 100 tasks (``Worker.submit``) then
  waits for each result, again and again; the Rust API's
  ``in_flight/100/1`` (100 ``submit_async`` on one target, then each
  waited for). Also ``submit().result()`` and ``call`` one at a time
  (their difference is the future's own cost), and the package's CPU per
  task in flight;
* registers and unregisters on one target, pickling excluded: the
  package's ``Worker.register_envelope`` of pre-packed distinct closures
  (64 small ones, 8 over 1 MiB of bytes), then their ``unregister``s;
  the Rust API's ``register_small/1``, ``register_1mib/1``,
  ``unregister_small/1``, ``unregister_1mib/1`` (the same closures'
  envelopes, made by the same interpreter).

Each round runs both sides of each comparison back to back, the Rust API
first in even rounds and the package first in odd ones.

Build the Rust side first (``cargo bench --no-run --features io,python
--bench floors``; the path it prints is ``--floors``); ``PYO3_PYTHON``
is set to this interpreter for it.

    python python/benchmarks/rust_api.py --floors target/release/deps/floors-HASH [--rounds 7] [--tasks 20000]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import callreg


def identity(x: int) -> int:
    return x


_UNITS = {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_OPERATIONS = ("register_small/1", "unregister_small/1", "register_1mib/1", "unregister_1mib/1")


def _floors(floors: str, word: str) -> str:
    env = dict(os.environ, PYO3_PYTHON=sys.executable)
    return subprocess.run(
        [floors, "--python", "--rounds", "1", word], env=env, check=True, capture_output=True, text=True
    ).stdout


def rust_rate(floors: str) -> float:
    """Tasks per second of the Rust API, 100 in flight on 1 Python target."""
    out = _floors(floors, "in_flight/100/1")
    found = re.search(r"^\| in_flight/100/1 \| (\d+) tasks/s \|", out, re.MULTILINE)
    if found is None:
        raise SystemExit("no in_flight/100/1 row in the floors output:\n" + out)
    return float(found.group(1))


def rust_operations(floors: str) -> dict[str, float]:
    """Seconds per register and unregister of the Rust API, 1 target."""
    out = _floors(floors, "register")
    times = {}
    for name in _OPERATIONS:
        found = re.search(r"^\| %s \| ([\d.]+) (ns|µs|ms|s) \|" % re.escape(name), out, re.MULTILINE)
        if found is None:
            raise SystemExit("no %s row in the floors output:\n%s" % (name, out))
        times[name] = float(found.group(1)) * _UNITS[found.group(2)]
    return times


def make_adder(n: int) -> Callable[[int], int]:
    def add(x: int) -> int:
        return x + n

    return add


def make_sized(data: bytes) -> Callable[[], int]:
    def size() -> int:
        return len(data)

    return size


def package_operations(worker: callreg.Worker, small: list[bytes], large: list[bytes]) -> dict[str, float]:
    """Seconds per ``register_envelope`` and ``unregister`` through the
    package, 1 target, of each batch of distinct envelopes."""
    times = {}
    for label, batch in (("small", small), ("1mib", large)):
        start = time.perf_counter()
        handles = [worker.register_envelope(envelope) for envelope in batch]
        middle = time.perf_counter()
        for handle in handles:
            worker.unregister(handle)
        end = time.perf_counter()
        times["register_%s/1" % label] = (middle - start) / len(batch)
        times["unregister_%s/1" % label] = (end - middle) / len(batch)
    return times


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
    operations: list[tuple[dict[str, float], dict[str, float]]] = []
    small = [callreg.pack(make_adder(i)) for i in range(64)]
    large = [callreg.pack(make_sized(bytes([i]) + bytes(range(256)) * 4095 + bytes(255))) for i in range(8)]
    with callreg.Worker(1, slot_capacity=128) as w:
        w.start()
        h = w.register(identity)
        package_rate(w, h, 2000)
        package_operations(w, small, large)
        for round_ in range(args.rounds):
            # Which side runs first alternates: the one that runs right
            # after the other's targets exit (or right after its own
            # one-at-a-time calls) is not always the same.
            if round_ % 2 == 0:
                rust = rust_rate(args.floors)
                rate, cpu = package_rate(w, h, args.tasks)
            else:
                rate, cpu = package_rate(w, h, args.tasks)
                rust = rust_rate(args.floors)
            call, submit = one_at_a_time(w, h, args.tasks // 4)
            rows.append((rust, rate, cpu, call, submit))
            if round_ % 2 == 0:
                rust_ops = rust_operations(args.floors)
                ours = package_operations(w, small, large)
            else:
                ours = package_operations(w, small, large)
                rust_ops = rust_operations(args.floors)
            operations.append((rust_ops, ours))
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
    print()
    print("| 1 target, pickling excluded | Rust API | package | package / Rust API (same round) |")
    print("|---|---:|---:|---:|")
    for name in _OPERATIONS:
        rust_time = statistics.median(rust[name] for rust, _ in operations)
        ours = statistics.median(package[name] for _, package in operations)
        ratio = statistics.median(package[name] / rust[name] for rust, package in operations)
        print("| %s | %.1f µs | %.1f µs | %.2f |" % (name, rust_time * 1e6, ours * 1e6, ratio))


if __name__ == "__main__":
    main()
