"""A task with one large ``bytes`` argument, callreg beside
ProcessPoolExecutor in the same process.

For each size (``--sizes``, MiB), each round: ``Worker.call(h, data)`` of
a registered ``len`` on a started ``Worker(1)``, and
``ProcessPoolExecutor(1, mp_context=fork).submit(len, data).result()``
(both pools started and warmed before the clock starts); wall and CPU
time (this process, all threads, plus the worker's, from /proc) per
task, the median of the rounds, and callreg's as a ratio to PPE's.

Run: ``python large_args.py [--sizes 8,32,128] [--rounds 3] [--json]``.
With ``--json`` it prints one JSON object (for ``--compare``); with
``--compare OLD NEW`` it runs this script under two interpreters (two
builds), alternately, and prints each build's ratios and NEW / OLD.
"""

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def measure(sizes, rounds):
    import peers

    import callreg

    out = {}
    worker = callreg.Worker(1)
    worker.start()
    ppe = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
    try:
        h = worker.register(len)
        worker.call(h, b"warm")
        ppe.submit(len, b"warm").result()
        target_pids = [worker.target_pid(t) for t in worker.targets]
        ppe_pids = list(ppe._processes)
        for size in sizes:
            data = b"x" * (size * 1024 * 1024)
            samples = {"callreg": [], "ppe": []}
            for _ in range(rounds):
                for name, pids, run in (
                    ("callreg", target_pids, lambda data=data: worker.call(h, data)),
                    ("ppe", ppe_pids, lambda data=data: ppe.submit(len, data).result()),
                ):
                    cpu0 = time.process_time() + peers.proc_cpu(pids)
                    t0 = time.perf_counter()
                    assert run() == len(data)
                    wall = time.perf_counter() - t0
                    cpu = time.process_time() + peers.proc_cpu(pids) - cpu0
                    samples[name].append((wall, cpu))
            out[str(size)] = {
                name: [statistics.median(s[0] for s in runs), statistics.median(s[1] for s in runs)]
                for name, runs in samples.items()
            }
    finally:
        worker.close()
        ppe.shutdown()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,32,128", help="argument sizes, MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="two interpreters, one build each")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.compare:
        results = {"old": [], "new": []}
        for i in range(args.rounds):
            order = (("old", args.compare[0]), ("new", args.compare[1]))
            for name, python in order if i % 2 == 0 else order[::-1]:
                command = [python, os.path.abspath(__file__), "--sizes", args.sizes, "--rounds", "1", "--json"]
                done = subprocess.run(command, check=True, capture_output=True, text=True)
                results[name].append(json.loads(done.stdout))
        print("command: %s %s" % (os.path.basename(sys.executable), " ".join(sys.argv)))
        print("load average (1/5/15 min): %.2f %.2f %.2f" % os.getloadavg())
        print()
        print("| MiB | build | callreg wall | callreg CPU | PPE wall | PPE CPU | wall / PPE | CPU / PPE |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        ratio = {}
        for size in sizes:
            for name in ("old", "new"):
                runs = [r[str(size)] for r in results[name]]

                def med(system, index, runs=runs):
                    return statistics.median(r[system][index] for r in runs)

                wall = statistics.median(r["callreg"][0] / r["ppe"][0] for r in runs)
                cpu = statistics.median(r["callreg"][1] / r["ppe"][1] for r in runs)
                ratio[(size, name)] = (wall, cpu)
                print(
                    "| %d | %s | %.3f s | %.3f s | %.3f s | %.3f s | %.3f× | %.3f× |"
                    % (size, name, med("callreg", 0), med("callreg", 1), med("ppe", 0), med("ppe", 1), wall, cpu)
                )
        print()
        for size in sizes:
            (ow, oc), (nw, nc) = ratio[(size, "old")], ratio[(size, "new")]
            print("%d MiB: new / old, as ratios to PPE: wall %.2f×, CPU %.2f×" % (size, nw / ow, nc / oc))
        return
    result = measure(sizes, args.rounds)
    if args.json:
        json.dump(result, sys.stdout)
    else:
        for size, row in result.items():
            print(
                "%s MiB: callreg %.3f s (CPU %.3f s), PPE %.3f s (CPU %.3f s)"
                % (size, row["callreg"][0], row["callreg"][1], row["ppe"][0], row["ppe"][1])
            )


if __name__ == "__main__":
    main()
