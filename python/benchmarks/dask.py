"""callreg.dask against plain Dask (and Ray, when installed) on one machine.

The cluster: ``distributed.LocalCluster(n_workers=2, threads_per_worker=1,
processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0")`` (loopback
only; the scheduler runs in this process, the workers under nannies in
child processes) and a ``callreg.dask.Cluster(client)`` on it (one callreg
target per Dask worker).

Three callables, a fresh one each round (each ``f(x) -> x + c``):
``trivial`` (a closure over an int), ``1mb`` and ``10mb`` (closures over
that many bytes of ``os.urandom``, so that no compression could shrink
them).

Systems, interleaved in every round (their order rotates round by round):

* ``callreg``: ``Cluster.register(fn)`` (timed on its own: the envelope
  crosses the network once per Dask worker), then ``--tasks`` times
  ``Cluster.submit(h, i)`` and one ``client.gather`` of the futures.
* ``callreg_map``: right after ``callreg``'s batch, with the same handle:
  ``list(Cluster.map(h, range(tasks)))``.
* ``dask_submit``: ``--tasks`` times ``client.submit(fn, i, pure=False)``,
  then ``client.gather``.
* ``dask_map``: ``client.map(fn, range(tasks), pure=False)``, then
  ``client.gather``.

Each is measured as wall time; CPU time of this process
(``time.process_time``: the client *and* the scheduler, which runs here);
CPU time of every descendant process (nannies, Dask workers, callreg's
forkservers and targets; ``psutil``); the bytes the loopback interface
carried (``lo`` in ``/proc/net/dev``: every TCP connection of the
cluster, headers included, and of anything else on the machine's
loopback; idle, it carries none here); and Dask's own counters of the
bytes its batched streams wrote (``BatchedSend.byte_count``: client to scheduler, scheduler to
workers, workers to scheduler, scheduler to client; a register's RPCs do
not go over these streams, so they count tasks only). Reported: the
median over ``--rounds`` rounds of each figure, and the median of the
same-round ratios callreg / Dask.

Ray (``ray.remote``), when ``import ray`` works, runs after the Dask
cluster closed (both at once would share the 2 cores), with the same
callables and counts: the first batch of a fresh remote function (its
export included) and a second batch of the same function. Its figures are
from another phase of the run, not interleaved with Dask's.

Goals: callreg's task throughput >= 10x Dask's at 10 MB; callreg's cost
per task on the trivial closure within 1.3x of Dask's ``submit``.

Run: ``python dask.py [--tasks 200] [--rounds 3] [--no-ray] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings

# Run as a script, this file's directory comes first on sys.path, where
# this file would stand in for the ``dask`` package that distributed imports.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import cloudpickle  # noqa: E402
import distributed  # noqa: E402
import psutil  # noqa: E402

import callreg  # noqa: E402
from callreg.dask import Cluster  # noqa: E402

CASES = {"trivial": 0, "1mb": 1_000_000, "10mb": 10_000_000}
SYSTEMS = ["callreg", "dask_submit", "dask_map"]
PAIRS = [("callreg", "dask_submit"), ("callreg", "dask_map"), ("callreg_map", "dask_map")]
WAIT = 120.0


def make_closure(size):
    """A fresh ``f(x) -> x + c`` closing over ``size`` random bytes (an
    int when ``size`` is 0); returns (f, c)."""
    if size == 0:
        k = int.from_bytes(os.urandom(2), "little")

        def trivial(x):
            return x + k

        return trivial, k
    blob = os.urandom(size)

    def closure(x):
        return x + len(blob)

    return closure, size


def descendants():
    return psutil.Process().children(recursive=True)


def proc_cpu(procs):
    """{pid: CPU seconds} of ``procs`` (gone ones left out)."""
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def loopback_bytes():
    """Bytes sent over the loopback interface so far (``lo`` tx)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


class Meter:
    """One measurement: wall, CPU and bytes between ``start`` and ``stop``."""

    def __init__(self, dask=None):
        self.dask = dask  # (LocalCluster, Client) for Dask's counters

    def stream_bytes(self):
        lc, client = self.dask
        sched = lc.scheduler
        w2s = client.run(lambda dask_worker: dask_worker.batched_stream.byte_count)
        return {
            "client_to_scheduler": client.scheduler_comm.byte_count,
            "scheduler_to_workers": sum(b.byte_count for b in sched.stream_comms.values()),
            "workers_to_scheduler": sum(w2s.values()),
            "scheduler_to_client": sched.client_comms[client.id].byte_count,
        }

    def start(self):
        self.streams0 = self.stream_bytes() if self.dask else None
        self.procs = descendants()
        self.children0 = proc_cpu(self.procs)
        self.lo0 = loopback_bytes()
        self.cpu0 = time.process_time()
        self.t0 = time.perf_counter()

    def stop(self):
        wall = time.perf_counter() - self.t0
        cpu = time.process_time() - self.cpu0
        lo = loopback_bytes() - self.lo0
        # Processes started during the measurement count from zero.
        known = {p.pid for p in self.procs}
        procs = self.procs + [p for p in descendants() if p.pid not in known]
        after = proc_cpu(procs)
        child_cpu = sum(c - self.children0.get(pid, 0.0) for pid, c in after.items())
        out = {"wall": wall, "cpu": cpu, "child_cpu": child_cpu, "loopback": lo}
        if self.dask:
            streams = self.stream_bytes()
            for k, v in streams.items():
                out[k] = v - self.streams0[k]
        return out


def settle(lc, deadline=10.0):
    """Waits (at most ``deadline`` s) until the scheduler forgot every task."""
    end = time.monotonic() + deadline
    while lc.scheduler.tasks and time.monotonic() < end:
        time.sleep(0.01)


def gather(client, futures):
    distributed.wait(futures, timeout=WAIT)
    return client.gather(futures)


def run_callreg(lc, client, cluster, fn, c, n):
    meter = Meter((lc, client))
    meter.start()
    h = cluster.register(fn)
    reg = meter.stop()
    meter.start()
    futures = [cluster.submit(h, i) for i in range(n)]
    results = gather(client, futures)
    tasks = meter.stop()
    check(results, c, n)
    del futures
    settle(lc)
    meter.start()
    results = list(cluster.map(h, range(n)))
    mapped = meter.stop()
    check(results, c, n)
    cluster.unregister(h)
    settle(lc)
    return {"register": reg, "tasks": tasks}, {"register": reg, "tasks": mapped}


def run_dask(lc, client, fn, c, n, use_map):
    meter = Meter((lc, client))
    meter.start()
    if use_map:
        futures = client.map(fn, range(n), pure=False)
    else:
        futures = [client.submit(fn, i, pure=False) for i in range(n)]
    results = gather(client, futures)
    tasks = meter.stop()
    check(results, c, n)
    del futures
    settle(lc)
    return {"tasks": tasks}


def check(results, c, n):
    if results != [i + c for i in range(n)]:
        raise AssertionError("wrong results")


def dask_phase(args, samples, deadline):
    warnings.filterwarnings("ignore", message="Sending large graph")
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            silence_logs=logging.CRITICAL,
        ) as lc,
        distributed.Client(lc) as client,
        Cluster(client) as cluster,
    ):
        cluster.wait_for_workers(2, timeout=WAIT)
        # Warm-up (not recorded): imports, connections, the targets' first task.
        fn, c = make_closure(0)
        run_callreg(lc, client, cluster, fn, c, 50)  # both batches
        run_dask(lc, client, fn, c, 50, False)
        run_dask(lc, client, fn, c, 50, True)
        rounds = 0
        for r in range(args.rounds):
            if time.monotonic() > deadline:
                print("time budget spent: %d rounds of %d" % (rounds, args.rounds), file=sys.stderr)
                break
            for case, size in CASES.items():
                fn, c = make_closure(size)
                order = SYSTEMS[r % len(SYSTEMS) :] + SYSTEMS[: r % len(SYSTEMS)]
                for system in order:
                    if system == "callreg":
                        out, mapped = run_callreg(lc, client, cluster, fn, c, args.tasks)
                        samples.setdefault("%s/callreg_map" % case, []).append(mapped)
                    else:
                        out = run_dask(lc, client, fn, c, args.tasks, system == "dask_map")
                    samples.setdefault("%s/%s" % (case, system), []).append(out)
                del fn
            rounds += 1
        return rounds


def ray_phase(args, samples, deadline):
    try:
        import ray
    except ImportError as exc:
        return "ray: not installed (%s)" % exc
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
        _node_ip_address="127.0.0.1",
    )
    try:
        warm = ray.remote(make_closure(0)[0])
        ray.get([warm.remote(i) for i in range(50)], timeout=WAIT)
        for _ in range(args.rounds):
            if time.monotonic() > deadline:
                break
            for case, size in CASES.items():
                fn, c = make_closure(size)
                remote = ray.remote(fn)
                for batch in ("ray_first", "ray_second"):
                    meter = Meter()
                    meter.start()
                    refs = [remote.remote(i) for i in range(args.tasks)]
                    results = ray.get(refs, timeout=WAIT)
                    out = meter.stop()
                    check(results, c, args.tasks)
                    del refs
                    samples.setdefault("%s/%s" % (case, batch), []).append({"tasks": out})
        return "ray %s" % ray.__version__
    finally:
        ray.shutdown()


def median(samples, key, part, field):
    return statistics.median(s[part][field] for s in samples[key])


def ratio_median(samples, a, b, field, invert=False):
    """The median of the same-round ratios a / b (b / a with ``invert``)."""
    pairs = zip(samples[a], samples[b], strict=False)
    values = [
        (y["tasks"][field] / x["tasks"][field]) if invert else (x["tasks"][field] / y["tasks"][field]) for x, y in pairs
    ]
    return statistics.median(values)


def fmt_bytes(n):
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return "%.2f %s" % (n / scale, unit)
    return "%.0f B" % n


def report(args, samples, rounds, ray_status, load_before, load_after):
    n = args.tasks
    cpu_model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    print("command: %s %s" % (os.path.basename(sys.executable), " ".join(sys.argv)))
    print(
        "machine: %s, %d CPUs, Linux %s; CPython %s, distributed %s, cloudpickle %s, psutil %s, callreg %s; %s"
        % (
            cpu_model,
            os.cpu_count(),
            platform.release(),
            platform.python_version(),
            distributed.__version__,
            cloudpickle.__version__,
            psutil.__version__,
            callreg.__version__ if hasattr(callreg, "__version__") else "0.1.0",
            ray_status,
        )
    )
    print("load average (1/5/15 min): before %.2f %.2f %.2f, after %.2f %.2f %.2f" % (load_before + load_after))
    print("date: %s" % time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print("tasks per batch: %d; rounds: %d (median shown)" % (n, rounds))
    print()
    print(
        "| case | system | tasks/s | wall per task | client+scheduler CPU per task | workers' CPU per task"
        " | loopback bytes per task | Dask streams per task (c→s, s→w, w→s, s→c) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    systems = ["callreg", "callreg_map", "dask_submit", "dask_map", "ray_first", "ray_second"]
    for case in CASES:
        for system in systems:
            key = "%s/%s" % (case, system)
            if key not in samples:
                continue

            def m(field, key=key):
                return median(samples, key, "tasks", field)

            streams = "—"
            if "client_to_scheduler" in samples[key][0]["tasks"]:
                streams = ", ".join(
                    fmt_bytes(m(f) / n)
                    for f in (
                        "client_to_scheduler",
                        "scheduler_to_workers",
                        "workers_to_scheduler",
                        "scheduler_to_client",
                    )
                )
            print(
                "| %s | %s | %.0f | %.0f µs | %.0f µs | %.0f µs | %s | %s |"
                % (
                    case,
                    system,
                    n / m("wall"),
                    m("wall") / n * 1e6,
                    m("cpu") / n * 1e6,
                    m("child_cpu") / n * 1e6,
                    fmt_bytes(m("loopback") / n),
                    streams,
                )
            )
    print()
    print("callreg registration (once per callable; median):")
    print(
        "| case | wall | client+scheduler CPU | workers' CPU | loopback bytes | tasks/s with it amortized over %d |" % n
    )
    print("|---|---:|---:|---:|---:|---:|")
    for case in CASES:
        key = "%s/callreg" % case

        def r(field, key=key):
            return median(samples, key, "register", field)

        amortized = statistics.median(n / (s["register"]["wall"] + s["tasks"]["wall"]) for s in samples[key])
        print(
            "| %s | %.2f ms | %.2f ms | %.2f ms | %s | %.0f |"
            % (
                case,
                r("wall") * 1e3,
                r("cpu") * 1e3,
                r("child_cpu") * 1e3,
                fmt_bytes(r("loopback")),
                amortized,
            )
        )
    print()
    print("same-round ratios, median (throughput: callreg / peer, higher is better; costs: callreg / peer):")
    print(
        "| case | callreg / peer | throughput | throughput, register amortized | wall per task"
        " | client+scheduler CPU per task | workers' CPU per task | all CPU per task |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    ratios = {}
    for case in CASES:
        for system, peer in PAIRS:
            mine = "%s/%s" % (case, system)
            other = "%s/%s" % (case, peer)
            thr = ratio_median(samples, mine, other, "wall", invert=True)
            amortized = statistics.median(
                o["tasks"]["wall"] / (s["register"]["wall"] + s["tasks"]["wall"])
                for s, o in zip(samples[mine], samples[other], strict=False)
            )
            total = statistics.median(
                (s["tasks"]["cpu"] + s["tasks"]["child_cpu"]) / (o["tasks"]["cpu"] + o["tasks"]["child_cpu"])
                for s, o in zip(samples[mine], samples[other], strict=False)
            )
            row = {
                "throughput": thr,
                "throughput_amortized": amortized,
                "wall": ratio_median(samples, mine, other, "wall"),
                "cpu": ratio_median(samples, mine, other, "cpu"),
                "child_cpu": ratio_median(samples, mine, other, "child_cpu"),
                "all_cpu": total,
            }
            ratios["%s/%s/%s" % (case, system, peer)] = row
            print(
                "| %s | %s / %s | %.2f× | %.2f× | %.2f× | %.2f× | %.2f× | %.2f× |"
                % (
                    case,
                    system,
                    peer,
                    row["throughput"],
                    row["throughput_amortized"],
                    row["wall"],
                    row["cpu"],
                    row["child_cpu"],
                    row["all_cpu"],
                )
            )
    print()
    for system, peer in PAIRS:
        row = ratios["10mb/%s/%s" % (system, peer)]
        print(
            "goal 10 MB throughput >= 10x: %s / %s %.2fx -> %s (register amortized over %d: %.2fx)"
            % (
                system,
                peer,
                row["throughput"],
                "met" if row["throughput"] >= 10 else "NOT met",
                n,
                row["throughput_amortized"],
            )
        )
    row = ratios["trivial/callreg/dask_submit"]
    for field, label in (("wall", "wall"), ("cpu", "client+scheduler CPU"), ("all_cpu", "all CPU")):
        print(
            "goal trivial closure cost per task <= 1.3x dask_submit (%s): %.2fx -> %s"
            % (label, row[field], "met" if row[field] <= 1.3 else "NOT met")
        )
    return ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200, help="tasks per batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds: no round starts past it")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray phase")
    parser.add_argument("--json", help="also write the raw samples here")
    args = parser.parse_args()

    # Every wait is bounded: past this, the run prints its threads and ends.
    faulthandler.dump_traceback_later(args.budget + 300, exit=True)
    load_before = os.getloadavg()
    deadline = time.monotonic() + args.budget
    samples = {}
    rounds = dask_phase(args, samples, deadline)
    ray_status = "ray: skipped (--no-ray)" if args.no_ray else ray_phase(args, samples, deadline)
    load_after = os.getloadavg()
    ratios = report(args, samples, rounds, ray_status, load_before, load_after)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": samples, "ratios": ratios, "rounds": rounds, "ray": ray_status}, f, indent=1)


if __name__ == "__main__":
    main()
