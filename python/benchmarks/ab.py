"""Two builds of the package side by side: round trip and small register.

Each build is an interpreter (a venv) with its own ``callreg`` installed,
e.g. one built from an older commit and one from this tree. The builds run
alternately, one process per round each (the order flips every round), and
each process measures, with the scenarios of ``peers.py``:

* ``echo``: the floor, a forked child echoing 8 bytes over two pipes;
* ``round_trip``: ``Worker.call`` of a trivial registered function, one at
  a time (``--calls`` per round);
* ``register_small``: ``Worker.register`` of a new closure over 16 bytes
  after start (``--registers`` per round);
* ``in_flight``: 100 ``Worker.submit`` then each ``result()``, per task
  (``--calls`` tasks per round, at least 100; with ``--in-flight``).

With ``--executor``, the scenarios are the Executor's instead, each with
``ProcessPoolExecutor(mp_context=fork)`` measured in the same process as
its floor (``ppe_*``): ``executor_round_trip`` and
``executor_submit_result`` (``submit(f, x).result()`` one at a time) and
``executor_in_flight`` (1000 futures submitted, then each waited for,
per task), with the ratios to the floor taken to PPE's figures.

With ``--load N``, N busy processes (pure Python loops) run through every
round, so both builds are measured loaded.

Every figure is also given as a ratio to the echo floor measured in the
same process, so that the builds are compared through ratios taken under
the same load. Wall and CPU time per operation (the parent's, all threads,
plus every target's, from /proc); the median of the rounds.

Run: ``python ab.py --before OLD/bin/python --after NEW/bin/python
[--rounds 7] [--workers 2] [--in-flight] [--load N]``.
"""

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = ("round_trip", "register_small")
IN_FLIGHT = 100


EXECUTOR_SCENARIOS = ("round_trip", "submit_result", "in_flight")


def measure_executor_here(args):
    """One round of the Executor's scenarios and PPE's, in this
    interpreter: {scenario: [wall, cpu]} per op."""
    sys.path.insert(0, HERE)
    import peers

    out = {}
    for cls, prefix in ((peers.Ppe, "ppe_"), (peers.Executor, "executor_")):
        for scenario in EXECUTOR_SCENARIOS:
            name = "throughput_all" if scenario == "in_flight" else scenario
            out[prefix + scenario] = list(peers.run_scenario(cls, name, args.workers, args))
    return out


def measure_here(args):
    """One round in this interpreter: {scenario: [wall, cpu]} per op."""
    sys.path.insert(0, HERE)
    import peers

    if args.executor:
        return measure_executor_here(args)
    out = {"echo": list(peers.echo_floor(args.calls))}
    for scenario in SCENARIOS:
        out[scenario] = list(peers.run_scenario(peers.Callreg, scenario, args.workers, args))
    if args.in_flight:
        system = peers.Callreg(args.workers)
        try:
            system.submit_many(IN_FLIGHT * 10)
            batches = max(1, args.calls // IN_FLIGHT)
            wall, cpu = peers.measure(system, lambda: system.submit_many(IN_FLIGHT), batches)
            out["in_flight"] = [wall / IN_FLIGHT, cpu / IN_FLIGHT]
        finally:
            system.close()
    return out


def run_build(python, args):
    command = (
        [
            python,
            os.path.abspath(__file__),
            "--measure",
            "--workers",
            str(args.workers),
            "--calls",
            str(args.calls),
            "--registers",
            str(args.registers),
        ]
        + (["--in-flight"] if args.in_flight else [])
        + (["--executor"] if args.executor else [])
    )
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def _busy():
    while True:
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="interpreter with the first build")
    parser.add_argument("--after", help="interpreter with the second build")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000, help="round trips per round")
    parser.add_argument("--registers", type=int, default=20, help="registers per round")
    parser.add_argument("--in-flight", action="store_true", help="also measure 100 tasks in flight")
    parser.add_argument("--load", type=int, default=0, help="busy processes running meanwhile")
    parser.add_argument("--executor", action="store_true", help="the Executor's scenarios, PPE as the floor")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        # Attributes run_scenario reads that this benchmark does not vary.
        args.batches, args.closure_calls = (3 if args.executor else 1), 1
        json.dump(measure_here(args), sys.stdout)
        return
    if not (args.before and args.after):
        parser.error("--before and --after are required")
    builds = {"before": args.before, "after": args.after}
    samples = {name: [] for name in builds}
    busy = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.load)]
    for process in busy:
        process.start()
    try:
        load_before = os.getloadavg()
        for i in range(args.rounds):
            order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
            for name in order:
                samples[name].append(run_build(builds[name], args))
        load_after = os.getloadavg()
    finally:
        for process in busy:
            process.terminate()
            process.join()

    def median(name, scenario, index):
        return statistics.median(s[scenario][index] for s in samples[name])

    def floor_ratio(name, scenario, index):
        floor = "ppe_" + scenario[len("executor_") :] if args.executor else "echo"
        return statistics.median(s[scenario][index] / s[floor][index] for s in samples[name])

    print("command: %s %s" % (os.path.basename(sys.executable), " ".join(sys.argv)))
    print("load average (1/5/15 min): before %.2f %.2f %.2f, after %.2f %.2f %.2f" % (load_before + load_after))
    print("workers: %d; rounds: %d (median shown); busy processes: %d" % (args.workers, args.rounds, args.load))
    print()
    if args.executor:
        print("| scenario | build | Executor wall | Executor CPU | PPE wall | PPE CPU | wall / PPE | CPU / PPE |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for scenario in EXECUTOR_SCENARIOS:
            for name in builds:
                print(
                    "| %s | %s | %.1f µs | %.1f µs | %.1f µs | %.1f µs | %.3f× | %.3f× |"
                    % (
                        scenario,
                        name,
                        median(name, "executor_" + scenario, 0) * 1e6,
                        median(name, "executor_" + scenario, 1) * 1e6,
                        median(name, "ppe_" + scenario, 0) * 1e6,
                        median(name, "ppe_" + scenario, 1) * 1e6,
                        floor_ratio(name, "executor_" + scenario, 0),
                        floor_ratio(name, "executor_" + scenario, 1),
                    )
                )
        print()
        for scenario in EXECUTOR_SCENARIOS:
            key = "executor_" + scenario
            wall = floor_ratio("after", key, 0) / floor_ratio("before", key, 0)
            cpu = floor_ratio("after", key, 1) / floor_ratio("before", key, 1)
            print("%s: after / before, as ratios to PPE: wall %.2f×, CPU %.2f×" % (scenario, wall, cpu))
        return

    print("| scenario | build | wall | CPU | wall / echo | CPU / echo |")
    print("|---|---|---:|---:|---:|---:|")
    scenarios = SCENARIOS + (("in_flight",) if args.in_flight else ())
    for scenario in ("echo",) + scenarios:
        for name in builds:
            print(
                "| %s | %s | %.1f µs | %.1f µs | %.2f× | %.2f× |"
                % (
                    scenario,
                    name,
                    median(name, scenario, 0) * 1e6,
                    median(name, scenario, 1) * 1e6,
                    floor_ratio(name, scenario, 0),
                    floor_ratio(name, scenario, 1),
                )
            )
    print()
    for scenario in scenarios:
        wall = floor_ratio("after", scenario, 0) / floor_ratio("before", scenario, 0)
        cpu = floor_ratio("after", scenario, 1) / floor_ratio("before", scenario, 1)
        print("%s: after / before, as ratios to the floor: wall %.2f×, CPU %.2f×" % (scenario, wall, cpu))


if __name__ == "__main__":
    main()
