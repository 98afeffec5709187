"""A three-level tree of Workers: this process (level 1) runs an outer
Worker with one SUB target and two next-level targets (level 2); each
next-level target runs an inner Worker of three SUB targets (level 3).

An orchestration callable registered on the outer Worker runs in a
next-level target as ``fn(ctx, *args)``: it maps a callable of the inner
Worker (registered by ``setup``) over the inner targets and sums.

Run: ``python3 examples/tree.py`` (with the callreg package installed:
``python3 -m pip install ./python``). Prints each line's expected value.
"""

import os

import callreg


def cube(x):
    return x**3


def setup(inner):
    """Runs in each next-level target before its inner Worker starts."""
    return {"cube": inner.register(cube)}


def sum_of_cubes(ctx, start, stop):
    """An orchestration callable: level 2 fans out to level 3."""
    return sum(ctx.inner.map(ctx.handles["cube"], range(start, stop)))


def where(*args):
    ctx = args[0] if args and isinstance(args[0], callreg.Context) else None
    if ctx is None:
        return "SUB target, pid %d" % os.getpid()
    return "next-level target %d, pid %d, inner targets %s" % (ctx.target, os.getpid(), ctx.inner.targets)


def main():
    level = callreg.NextLevel(3, setup=setup)
    with callreg.Worker(1, next_level=level, next_level_targets=2) as w:
        w.start()
        print("SUB targets", w.sub_targets, "next-level targets", w.next_level_targets)  # [0] [1, 2]
        show = w.register(where)
        for t in w.targets:
            print(t, w.call(show, target=t))
        orchestrate = w.register(sum_of_cubes)
        # Two halves of 0..99, one per next-level target, each spread over
        # its three inner targets.
        halves = [w.submit(orchestrate, 0, 50, target=1), w.submit(orchestrate, 50, 100, target=2)]
        total = sum(f.result() for f in halves)
        print("sum of cubes below 100:", total, total == sum(x**3 for x in range(100)))  # 24502500 True
        w.unregister(orchestrate)
        w.unregister(show)


if __name__ == "__main__":
    main()
