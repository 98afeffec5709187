"""callreg against the pools a Python user would pick, interleaved in one run.

Systems, each with N workers (``--workers``, default ``os.cpu_count()``):

* ``callreg``: ``callreg.Worker(N)``; tasks name a registered handle.
* ``ppe``: ``concurrent.futures.ProcessPoolExecutor(N, mp_context=fork)``;
  the function travels (pickled) with every task.
* ``loky``: ``loky.ProcessPoolExecutor(N)`` (cloudpickle, its default
  ``loky`` start method); the function travels with every task.

Scenarios:

* ``round_trip``: one trivial call (``f(x) -> x``) at a time, waited for
  before the next; time per call.
* ``throughput_1`` / ``throughput_all``: 1000 futures of the trivial call in
  flight (all submitted, then all waited for), with 1 worker and with N;
  tasks per second.
* ``register_small`` / ``register_1mib``: callreg: ``Worker.register`` of a
  closure (over a small value / over 1 MiB of bytes) after start, which
  returns once every target installed it. The peers have no registration:
  what they pay instead is shipping the closure with a task, so their row
  is one call of that closure (``submit(closure).result()``), a cost they
  pay on every task (for ``ppe``, whose pickler refuses closures, the
  closure's cloudpickle bytes and a function that loads and calls them).

Every scenario runs in each of ``--rounds`` rounds, systems in turn
(interleaved), and the median of the rounds is reported, with wall time and
CPU time (the parent's, all threads, plus every worker process's, from
/proc) per operation. Output: a Markdown table and the ratios the goals
name. Run: ``python peers.py [--rounds 5] [--workers N] [--json FILE]``.
"""

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time

import cloudpickle

import callreg

try:
    import loky
except ImportError:  # reported in the output
    loky = None


def trivial(x):
    return x


def make_closure(size):
    blob = b"x" * size

    def closure():
        return len(blob)

    return closure


def proc_cpu(pids):
    """CPU seconds (user + system) used so far by processes ``pids``."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open("/proc/%d/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total / ticks


class System:
    name = ""

    def __init__(self, workers):
        self.workers = workers

    def pids(self):
        raise NotImplementedError

    def close(self):
        raise NotImplementedError


class Callreg(System):
    name = "callreg"

    def __init__(self, workers):
        super().__init__(workers)
        self.w = callreg.Worker(workers)
        self.w.start()
        self.h = self.w.register(trivial)

    def pids(self):
        return [self.w.target_pid(t) for t in self.w.targets]

    def call(self):
        return self.w.call(self.h, 1)

    def submit_many(self, n):
        futures = [self.w.submit(self.h, i) for i in range(n)]
        return [f.result() for f in futures]

    def closure_cost(self, fn):
        return self.w.register(fn)

    def close(self):
        self.w.close()


class Pool(System):
    def pids(self):
        return list(self.ex._processes)

    def call(self):
        return self.ex.submit(trivial, 1).result()

    def submit_many(self, n):
        futures = [self.ex.submit(trivial, i) for i in range(n)]
        return [f.result() for f in futures]

    def closure_cost(self, fn):
        return self.ex.submit(fn).result()

    def warm(self):
        # Start every worker process before timing.
        list(self.ex.map(trivial, range(self.workers * 4)))

    def close(self):
        self.ex.shutdown(wait=True)


def run_pickled(data):
    return cloudpickle.loads(data)()


class Ppe(Pool):
    name = "ppe"

    def closure_cost(self, fn):
        # The standard pickler refuses closures: ship cloudpickle bytes.
        return self.ex.submit(run_pickled, cloudpickle.dumps(fn)).result()

    def __init__(self, workers):
        super().__init__(workers)
        self.ex = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("fork")
        )
        self.warm()


class Loky(Pool):
    name = "loky"

    def __init__(self, workers):
        super().__init__(workers)
        self.ex = loky.ProcessPoolExecutor(workers)
        self.warm()


def measure(system, op, count):
    """(wall seconds, CPU seconds) per operation for ``count`` runs of ``op``."""
    pids = system.pids()
    cpu0 = time.process_time() + proc_cpu(pids)
    t0 = time.perf_counter()
    for _ in range(count):
        op()
    wall = time.perf_counter() - t0
    cpu = time.process_time() + proc_cpu(pids) - cpu0
    return wall / count, cpu / count


SCENARIOS = ["round_trip", "throughput_1", "throughput_all", "register_small", "register_1mib"]


def run_scenario(cls, scenario, workers, args):
    """One round of ``scenario`` on a fresh ``cls`` system: (wall, cpu) per op."""
    system = cls(1 if scenario == "throughput_1" else workers)
    try:
        if scenario == "round_trip":
            for _ in range(50):
                system.call()
            return measure(system, system.call, args.calls)
        if scenario.startswith("throughput"):
            system.submit_many(200)
            wall, cpu = measure(system, lambda: system.submit_many(1000), args.batches)
            return wall / 1000, cpu / 1000
        size = 16 if scenario == "register_small" else 1024 * 1024
        closures = [make_closure(size) for _ in range(args.registers)]
        it = iter(closures)
        return measure(system, lambda: system.closure_cost(next(it)), len(closures))
    finally:
        system.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--calls", type=int, default=2000, help="round trips per round")
    parser.add_argument("--batches", type=int, default=3, help="1000-future batches per round")
    parser.add_argument("--registers", type=int, default=20, help="registers per round")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()

    systems = [Callreg, Ppe] + ([Loky] if loky else [])
    load_before = os.getloadavg()
    samples = {(s.name, sc): [] for s in systems for sc in SCENARIOS}
    for _ in range(args.rounds):
        for scenario in SCENARIOS:
            for cls in systems:
                samples[(cls.name, scenario)].append(run_scenario(cls, scenario, args.workers, args))
    load_after = os.getloadavg()

    def median(name, scenario, index):
        return statistics.median(s[index] for s in samples[(name, scenario)])

    cpu_model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    print("command: %s %s" % (os.path.basename(sys.executable), " ".join(sys.argv)))
    print(
        "machine: %s, %d CPUs, Linux %s; CPython %s, cloudpickle %s, loky %s, callreg %s"
        % (
            cpu_model,
            os.cpu_count(),
            platform.release(),
            platform.python_version(),
            cloudpickle.__version__,
            loky.__version__ if loky else "not installed",
            "0.1.0",
        )
    )
    print(
        "load average (1/5/15 min): before %.2f %.2f %.2f, after %.2f %.2f %.2f"
        % (load_before + load_after)
    )
    print("workers: %d; rounds: %d (median shown)" % (args.workers, args.rounds))
    print()
    names = [s.name for s in systems]
    print("| scenario | unit | " + " | ".join("%s wall | %s CPU" % (n, n) for n in names) + " | callreg / ppe (wall) |")
    print("|---|---|" + "---|---|" * len(names) + "---|")
    table = {}
    for scenario in SCENARIOS:
        throughput = scenario.startswith("throughput")
        row = []
        for name in names:
            wall, cpu = median(name, scenario, 0), median(name, scenario, 1)
            table[(name, scenario)] = (wall, cpu)
            if throughput:
                row.append("%.0f/s | %.1f µs" % (1 / wall, cpu * 1e6))
            else:
                row.append("%.1f µs | %.1f µs" % (wall * 1e6, cpu * 1e6))
        ratio = table[("callreg", scenario)][0] / table[("ppe", scenario)][0]
        shown = ("%.2f× (throughput %.2f×)" % (ratio, 1 / ratio)) if throughput else "%.2f×" % ratio
        unit = "tasks/s, CPU per task" if throughput else "per op"
        print("| %s | %s | %s | %s |" % (scenario, unit, " | ".join(row), shown))
    print()
    rt = table[("callreg", "round_trip")][0] / table[("ppe", "round_trip")][0]
    print("goal round trip <= 0.5x ProcessPoolExecutor's: %.2fx -> %s" % (rt, "met" if rt <= 0.5 else "NOT met"))
    for scenario in ("throughput_1", "throughput_all"):
        gain = table[("ppe", scenario)][0] / table[("callreg", scenario)][0]
        print(
            "goal %s >= 2x ProcessPoolExecutor's: %.2fx -> %s"
            % (scenario, gain, "met" if gain >= 2 else "NOT met")
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"%s/%s" % k: v for k, v in samples.items()}, f, indent=1)


if __name__ == "__main__":
    main()
