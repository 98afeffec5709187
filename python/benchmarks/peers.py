"""callreg against the pools a Python user would pick, interleaved in one run.

Systems, each with N workers (``--workers``, default ``os.cpu_count()``):

* ``callreg``: ``callreg.Worker(N)``; tasks name a registered handle.
* ``executor``: ``callreg.Executor(N)``, used as the peers are (the
  function given with every task; registered once, at its first use).
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
* ``start``: a new pool of N workers to its first result (callreg:
  ``Worker(N)``, ``start()``, ``register(trivial)``, one ``call``; the
  peers: the executor and one ``submit(trivial, 1).result()``); CPU time
  counts the parent and every worker process until it was reaped.
* ``submit_result``: ``submit(f, x).result()`` one at a time (callreg: a
  registered handle), beside ``round_trip`` (callreg: ``call``).
* ``map_10k`` / ``map_10k_c100``: ``list(map(f, range(10000)))`` with
  ``chunksize=1`` (the default) / ``chunksize=100``, time per item.
* ``closure_50mb``: a closure over 50 MB of bytes, then 200 calls of it
  one at a time, total time: callreg registers it once (the Worker) or
  at its first use (the Executor); ppe, whose pickler refuses closures,
  is given the closure's cloudpickle bytes with each task; loky pickles
  it with each task.
* ``register_small`` / ``register_1mib``: callreg: ``Worker.register`` of a
  closure (over a small value / over 1 MiB of bytes) after start, which
  returns once every target installed it. The peers have no registration:
  what they pay instead is shipping the closure with a task, so their row
  is one call of that closure (``submit(closure).result()``), a cost they
  pay on every task (for ``ppe``, whose pickler refuses closures, the
  closure's cloudpickle bytes and a function that loads and calls them).

The floor, ``echo``: a forked child that echoes 8 bytes over a pair of
pipes, ``os.write`` then ``os.read`` from Python, one at a time: the least
a Python round trip through a second process costs on this machine; the
round trips are also given as ratios to it.

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
import pickle
import platform
import resource
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

    def submit_result(self):
        return self.w.submit(self.h, 1).result()

    def map_items(self, n, chunksize=1):
        return list(self.w.map(self.h, range(n), chunksize=chunksize))

    def closure_calls(self, fn, n):
        h = self.w.register(fn)
        for _ in range(n):
            self.w.call(h)
        self.w.unregister(h)

    @staticmethod
    def first_result(workers):
        w = callreg.Worker(workers)
        w.start()
        w.call(w.register(trivial), 1)
        return w.close

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

    def submit_result(self):
        return self.ex.submit(trivial, 1).result()

    def map_items(self, n, chunksize=1):
        return list(self.ex.map(trivial, range(n), chunksize=chunksize))

    def closure_calls(self, fn, n):
        for _ in range(n):
            self.ex.submit(fn).result()

    @classmethod
    def first_result(cls, workers):
        ex = cls.executor(workers)
        ex.submit(trivial, 1).result()
        return lambda: ex.shutdown(wait=True)

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

    def closure_calls(self, fn, n):
        for _ in range(n):
            self.ex.submit(run_pickled, cloudpickle.dumps(fn)).result()

    @staticmethod
    def executor(workers):
        return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))

    def __init__(self, workers):
        super().__init__(workers)
        self.ex = self.executor(workers)
        self.warm()


class Executor(Pool):
    name = "executor"

    @staticmethod
    def executor(workers):
        return callreg.Executor(workers)

    def __init__(self, workers):
        super().__init__(workers)
        self.ex = self.executor(workers)
        self.warm()

    def pids(self):
        w = self.ex.worker
        return [w.target_pid(t) for t in w.targets]


class Loky(Pool):
    name = "loky"

    @staticmethod
    def executor(workers):
        # A new executor each time (loky's get_reusable_executor would
        # reuse warm workers).
        return loky.ProcessPoolExecutor(workers)

    def __init__(self, workers):
        super().__init__(workers)
        self.ex = self.executor(workers)
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


SCENARIOS = [
    "start",
    "round_trip",
    "submit_result",
    "throughput_1",
    "throughput_all",
    "map_10k",
    "map_10k_c100",
    "register_small",
    "register_1mib",
    "closure_50mb",
]


def measure_start(cls, workers):
    """(wall seconds to the first result, CPU seconds of the parent and its
    reaped children until the pool closed)."""
    cpu0 = time.process_time() + children_cpu()
    t0 = time.perf_counter()
    close = cls.first_result(workers)
    wall = time.perf_counter() - t0
    close()
    return wall, time.process_time() + children_cpu() - cpu0


def private_dirty_mb(pid):
    """Private dirty memory of process ``pid`` (MB, /proc/PID/smaps_rollup)."""
    with open("/proc/%d/smaps_rollup" % pid) as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def idle_memory(workers):
    """{system: median private dirty MB of an idle worker process} after
    one task each (callreg: a registered trivial callable)."""
    out = {}
    for cls in (Callreg, Ppe):
        system = cls(workers)
        try:
            system.submit_many(10)
            time.sleep(0.3)
            out[cls.name] = statistics.median(private_dirty_mb(p) for p in system.pids())
        finally:
            system.close()
    return out


def wrapper_cost(count=100000):
    """Seconds per ``Worker.call`` spent in the package's Python code: the
    call with the extension module's worker replaced by a stub that
    answers at once (the stub's own call included)."""
    w = callreg.Worker(1)
    try:
        w.start()
        h = w.register(trivial)
        real = w._raw
        answer = pickle.dumps(1, protocol=pickle.HIGHEST_PROTOCOL)

        class Stub:
            def call(self, raw, target, data):
                return answer

        w._raw = Stub()
        try:
            t0 = time.perf_counter()
            for _ in range(count):
                w.call(h, 1)
            return (time.perf_counter() - t0) / count
        finally:
            w._raw = real
    finally:
        w.close()


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def echo_floor(count):
    """(wall, CPU) per round trip of 8 bytes through a forked echo child."""
    child_in, to_child = os.pipe()
    from_child, child_out = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(to_child)
            os.close(from_child)
            while True:
                data = os.read(child_in, 8)
                if not data:
                    break
                os.write(child_out, data)
        finally:
            os._exit(0)
    os.close(child_in)
    os.close(child_out)
    message = b"12345678"
    for _ in range(100):
        os.write(to_child, message)
        os.read(from_child, 8)
    cpu0 = time.process_time() + proc_cpu([pid])
    t0 = time.perf_counter()
    for _ in range(count):
        os.write(to_child, message)
        os.read(from_child, 8)
    wall = time.perf_counter() - t0
    cpu = time.process_time() + proc_cpu([pid]) - cpu0
    os.close(to_child)
    os.close(from_child)
    os.waitpid(pid, 0)
    return wall / count, cpu / count


def run_scenario(cls, scenario, workers, args):
    """One round of ``scenario`` on a fresh ``cls`` system: (wall, cpu) per op."""
    if scenario == "start":
        return measure_start(cls, workers)
    system = cls(1 if scenario == "throughput_1" else workers)
    try:
        if scenario in ("round_trip", "submit_result"):
            op = system.call if scenario == "round_trip" else system.submit_result
            for _ in range(50):
                op()
            return measure(system, op, args.calls)
        if scenario.startswith("map_10k"):
            chunksize = 100 if scenario == "map_10k_c100" else 1
            system.map_items(1000, chunksize)
            wall, cpu = measure(system, lambda: system.map_items(10000, chunksize), 1)
            return wall / 10000, cpu / 10000
        if scenario == "closure_50mb":
            fn = make_closure(50 * 1000 * 1000)
            return measure(system, lambda: system.closure_calls(fn, args.closure_calls), 1)
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
    parser.add_argument("--closure-calls", type=int, default=200, help="calls of the 50 MB closure per round")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()

    systems = [Callreg, Executor, Ppe] + ([Loky] if loky else [])
    load_before = os.getloadavg()
    samples = {(s.name, sc): [] for s in systems for sc in SCENARIOS}
    samples[("floor", "echo")] = []
    for _ in range(args.rounds):
        samples[("floor", "echo")].append(echo_floor(args.calls))
        for scenario in SCENARIOS:
            for cls in systems:
                samples[(cls.name, scenario)].append(run_scenario(cls, scenario, args.workers, args))
    memory = idle_memory(args.workers)
    wrapper = wrapper_cost()
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
    print("load average (1/5/15 min): before %.2f %.2f %.2f, after %.2f %.2f %.2f" % (load_before + load_after))
    print("workers: %d; rounds: %d (median shown)" % (args.workers, args.rounds))
    print()
    names = [s.name for s in systems]
    print("| scenario | unit | " + " | ".join("%s wall | %s CPU" % (n, n) for n in names) + " | callreg / ppe (wall) |")
    print("|---|---|" + "---|---|" * len(names) + "---|")
    table = {}
    for scenario in SCENARIOS:
        throughput = scenario.startswith("throughput") or scenario.startswith("map_10k")
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
    echo = median("floor", "echo", 0), median("floor", "echo", 1)
    print("| echo (floor) | per op | %.1f µs | %.1f µs |" % (echo[0] * 1e6, echo[1] * 1e6))
    print()
    for scenario in ("round_trip", "submit_result"):
        wall, cpu = table[("callreg", scenario)]
        print("callreg %s / echo floor: wall %.2fx, CPU %.2fx" % (scenario, wall / echo[0], cpu / echo[1]))
    print(
        "idle worker private dirty: callreg %.1f MB, ppe %.1f MB (goal <= ppe + 2 MB: %s)"
        % (memory["callreg"], memory["ppe"], "met" if memory["callreg"] <= memory["ppe"] + 2 else "NOT met")
    )
    print("the package's own Python cost per Worker.call: %.2f µs (goal <= 3)" % (wrapper * 1e6))
    gap = (table[("callreg", "submit_result")][0] - table[("callreg", "round_trip")][0]) * 1e6
    print("callreg submit().result() - call: %+.1f µs (goal <= 10)" % gap)
    st = table[("callreg", "start")][0] / table[("ppe", "start")][0]
    print("goal start <= 2x ProcessPoolExecutor's: %.2fx -> %s" % (st, "met" if st <= 2 else "NOT met"))
    rt = table[("callreg", "round_trip")][0] / table[("ppe", "round_trip")][0]
    print("goal round trip <= 0.5x ProcessPoolExecutor's: %.2fx -> %s" % (rt, "met" if rt <= 0.5 else "NOT met"))
    for scenario in ("throughput_1", "throughput_all"):
        gain = table[("ppe", scenario)][0] / table[("callreg", scenario)][0]
        print("goal %s >= 2x ProcessPoolExecutor's: %.2fx -> %s" % (scenario, gain, "met" if gain >= 2 else "NOT met"))
    for name in ("callreg", "executor"):
        for scenario, least in (("map_10k", 2), ("map_10k_c100", 1), ("throughput_1", 2)):
            gain = table[("ppe", scenario)][0] / table[(name, scenario)][0]
            print(
                "goal %s %s >= %dx ProcessPoolExecutor's: %.2fx -> %s"
                % (name, scenario, least, gain, "met" if gain >= least else "NOT met")
            )
    for peer in ("ppe", "loky"):
        if (peer, "closure_50mb") in table:
            print(
                "closure over 50 MB, %d calls: executor %.3f s, %s %.3f s (%.1fx)"
                % (
                    args.closure_calls,
                    table[("executor", "closure_50mb")][0],
                    peer,
                    table[(peer, "closure_50mb")][0],
                    table[(peer, "closure_50mb")][0] / table[("executor", "closure_50mb")][0],
                )
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"%s/%s" % k: v for k, v in samples.items()}, f, indent=1)


if __name__ == "__main__":
    main()
