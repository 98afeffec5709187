"""An orchestration round trip against the two single-level round trips it
is made of, measured in one run.

One Worker: SUB target 0 and next-level target 1, whose inner Worker has
one SUB target. Per round, in turn:

* ``outer``: ``w.call(identity, 0, target=0)`` — parent to a SUB target and
  back (one level);
* ``inner``: the same call made inside the next-level child,
  ``ctx.inner.call(identity, 0)`` — next-level child to its inner target
  and back (one level), timed there;
* ``orchestration``: ``w.call(orchestrate, 0, target=1)`` where
  ``orchestrate(ctx, x)`` returns ``ctx.inner.call(identity, x)`` — parent
  to the next-level child, to its inner target, and back up.

Each is ``--calls`` calls one at a time (each waited for before the next);
the median over ``--rounds`` rounds is reported, wall time and CPU time
(user + system, from /proc, summed over every process the path crosses:
the parent and the SUB target for ``outer``; the next-level child and its
inner target for ``inner``; all three for ``orchestration``) per call.
Output: a Markdown table and the ratio of ``orchestration`` to ``outer +
inner``. Run: ``python tree.py [--rounds 7] [--calls 2000] [--json FILE]``.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

# The benchmarks' shared CPU-time reading (this directory is sys.path[0]).
from peers import proc_cpu

import callreg


def identity(x):
    return x


def setup(inner):
    return {"identity": inner.register(identity)}


def orchestrate(ctx, x):
    return ctx.inner.call(ctx.handles["identity"], x)


def inner_round(ctx, calls):
    """``calls`` inner round trips, timed here: (wall s, CPU s)."""
    h = ctx.handles["identity"]
    pids = [os.getpid()] + [ctx.inner.target_pid(t) for t in ctx.inner.targets]
    ctx.inner.call(h, 0)
    cpu0, t0 = proc_cpu(pids), time.perf_counter()
    for _ in range(calls):
        ctx.inner.call(h, 0)
    return time.perf_counter() - t0, proc_cpu(pids) - cpu0


def timed(pids, calls, fn):
    fn()
    cpu0, t0 = proc_cpu(pids), time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0, proc_cpu(pids) - cpu0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = {"outer": [], "inner": [], "orchestration": []}
    load_before = os.getloadavg()[0]
    with callreg.Worker(1, next_level=callreg.NextLevel(1, setup=setup)) as w:
        w.start()
        sub = w.register(identity)
        orch = w.register(orchestrate)
        inner = w.register(inner_round)
        pids_of = w.register(lambda ctx: [ctx.inner.target_pid(t) for t in ctx.inner.targets])
        me = os.getpid()
        sub_pid, upper_pid = w.target_pid(0), w.target_pid(1)
        inner_pids = w.call(pids_of, target=1)
        for _ in range(args.rounds):
            rows["outer"].append(timed([me, sub_pid], args.calls, lambda: w.call(sub, 0, target=0)))
            rows["inner"].append(tuple(w.call(inner, args.calls, target=1)))
            rows["orchestration"].append(
                timed([me, upper_pid] + inner_pids, args.calls, lambda: w.call(orch, 0, target=1))
            )
    load_after = os.getloadavg()[0]
    per_call = {
        name: (
            statistics.median(r[0] for r in results) / args.calls * 1e6,
            statistics.median(r[1] for r in results) / args.calls * 1e6,
        )
        for name, results in rows.items()
    }
    both = tuple(per_call["outer"][i] + per_call["inner"][i] for i in range(2))
    print(
        "CPython %s, %d CPUs, load %.1f -> %.1f, %d rounds of %d calls"
        % (platform.python_version(), os.cpu_count(), load_before, load_after, args.rounds, args.calls)
    )
    print()
    print("| round trip | wall per call | CPU per call |")
    print("|---|---:|---:|")
    for name, label in (
        ("outer", "outer: parent → SUB target → parent"),
        ("inner", "inner: next-level child → inner target → next-level child"),
        ("orchestration", "orchestration: parent → next-level child → inner target → back"),
    ):
        print("| %s | %.1f µs | %.1f µs |" % (label, per_call[name][0], per_call[name][1]))
    print("| outer + inner | %.1f µs | %.1f µs |" % both)
    print()
    print(
        "orchestration / (outer + inner): %.2f× wall, %.2f× CPU"
        % (per_call["orchestration"][0] / both[0], per_call["orchestration"][1] / both[1])
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"per_call_us": per_call, "rounds": rows, "load": [load_before, load_after]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
