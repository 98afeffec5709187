"""callreg's two start methods beside ProcessPoolExecutor's, in one run.

Systems, each with ``--workers`` workers (default 4):

* ``callreg fork`` / ``callreg forkserver``: ``callreg.Worker(N,
  start_method=...)``;
* ``ppe fork`` / ``ppe forkserver``:
  ``concurrent.futures.ProcessPoolExecutor(N, mp_context=...)``.

Scenarios, each round running every system in turn (interleaved):

* ``start``: a new pool to its first result (callreg: ``Worker`` +
  ``start()`` + ``register`` of a trivial function + one ``call``; the
  peers: the executor and one ``submit(trivial, 1).result()``); CPU time
  counts the parent and every process it reaped until the pool closed
  (under ``forkserver`` that leaves out ProcessPoolExecutor's workers and
  its forkserver process, which are not the parent's children: compare
  CPU under ``fork`` only);
* ``first_call``: on that pool, the next ``call`` / ``submit().result()``
  after the first result (one round trip once started);
* ``replacement`` (callreg only; a ProcessPoolExecutor whose worker is
  killed is broken, it never replaces it): ``kill -9`` of target 0 to the
  first result of a ``call`` on target 0's replacement (wall time).

The median of ``--rounds`` rounds; callreg's figures are also given as a
ratio to ProcessPoolExecutor's with the same start method, from the same
round. Run: ``python start_methods.py [--rounds 7] [--workers 4]``.
"""

import argparse
import concurrent.futures
import multiprocessing
import os
import platform
import resource
import signal
import statistics
import sys
import time

import callreg


def trivial(x):
    return x


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def callreg_round(workers, method):
    """(start wall, start CPU, first call wall, replacement wall) seconds."""
    cpu0 = time.process_time() + children_cpu()
    t0 = time.perf_counter()
    w = callreg.Worker(workers, start_method=method)
    w.start()
    h = w.register(trivial)
    w.call(h, 1, target=0)
    start = time.perf_counter() - t0
    t1 = time.perf_counter()
    w.call(h, 2, target=0)
    first_call = time.perf_counter() - t1
    old = w.target_pid(0)
    t2 = time.perf_counter()
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        try:
            if w.target_incarnation(0) > 0 and w.target_phase(0) == "joined":
                w.call(h, 3, target=0)
                break
        except callreg.CallregError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("no replacement joined within 30 s")
        time.sleep(0.0005)
    replacement = time.perf_counter() - t2
    w.close()
    cpu = time.process_time() + children_cpu() - cpu0
    return start, cpu, first_call, replacement


def ppe_round(workers, method):
    """(start wall, start CPU, first call wall)."""
    cpu0 = time.process_time() + children_cpu()
    t0 = time.perf_counter()
    ex = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method))
    ex.submit(trivial, 1).result()
    start = time.perf_counter() - t0
    t1 = time.perf_counter()
    ex.submit(trivial, 2).result()
    first_call = time.perf_counter() - t1
    ex.shutdown(wait=True)
    cpu = time.process_time() + children_cpu() - cpu0
    return start, cpu, first_call


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    methods = ("fork", "forkserver")
    samples = {}
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for method in methods:
            samples.setdefault(("callreg", method), []).append(callreg_round(args.workers, method))
            samples.setdefault(("ppe", method), []).append(ppe_round(args.workers, method))
    load_after = os.getloadavg()

    def median(system, method, index):
        return statistics.median(s[index] for s in samples[(system, method)])

    def ratio(method, index):
        pairs = zip(samples[("callreg", method)], samples[("ppe", method)], strict=True)
        return statistics.median(c[index] / p[index] for c, p in pairs)

    print("command: %s %s" % (os.path.basename(sys.executable), " ".join(sys.argv)))
    print("CPython %s, Linux %s, %d CPUs" % (platform.python_version(), platform.release(), os.cpu_count()))
    print("load average (1/5/15 min): before %.2f %.2f %.2f, after %.2f %.2f %.2f" % (load_before + load_after))
    print("workers: %d; rounds: %d (median shown)" % (args.workers, args.rounds))
    print()
    print("| scenario | method | callreg | ProcessPoolExecutor | callreg / PPE (same round, median) |")
    print("|---|---|---:|---:|---:|")
    for method in methods:
        print(
            "| start to first result, wall | %s | %.1f ms | %.1f ms | %.2f× |"
            % (method, median("callreg", method, 0) * 1e3, median("ppe", method, 0) * 1e3, ratio(method, 0))
        )
        print(
            "| start to first result, CPU | %s | %.1f ms | %.1f ms | %.2f× |"
            % (method, median("callreg", method, 1) * 1e3, median("ppe", method, 1) * 1e3, ratio(method, 1))
        )
        print(
            "| next call after the first | %s | %.1f µs | %.1f µs | %.2f× |"
            % (method, median("callreg", method, 2) * 1e6, median("ppe", method, 2) * 1e6, ratio(method, 2))
        )
        print(
            "| kill -9 to a result from the replacement | %s | %.1f ms | (no replacement: the pool breaks) | |"
            % (method, median("callreg", method, 3) * 1e3)
        )


if __name__ == "__main__":
    main()
