"""callreg.Executor: a concurrent.futures.Executor over a Worker, a
one-line switch from ProcessPoolExecutor(mp_context=fork)."""

import asyncio
import concurrent.futures
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import outputs_of

import callreg


def cube(x):
    return x**3


def slow(x, seconds):
    time.sleep(seconds)
    return x


def fails_at(x, bad):
    if x == bad:
        raise ValueError("bad item %d" % x)
    return x


def keywords(a, *, target=None, timeout=None):
    return (a, target, timeout)


INITIALIZED = None


def initialize(value):
    global INITIALIZED
    INITIALIZED = (value, os.getpid())


def initialized():
    return INITIALIZED


def ppe_style_program(executor_class, **options):
    """What a ProcessPoolExecutor user writes; returns what it computed."""
    out = {}
    with executor_class(2, **options) as ex:
        futures = {ex.submit(cube, i): i for i in range(10)}
        out["as_completed"] = sorted((futures[f], f.result()) for f in concurrent.futures.as_completed(futures))
        out["map"] = list(ex.map(cube, range(20)))
        out["map_chunked"] = list(ex.map(cube, range(20), chunksize=6))
        out["map_two"] = list(ex.map(pow, [2, 3, 4], [5, 6, 7]))
        done, _ = concurrent.futures.wait([ex.submit(slow, i, 0.01) for i in range(4)])
        out["wait"] = sorted(f.result() for f in done)
        try:
            list(ex.map(fails_at, range(5), [3] * 5))
        except ValueError as error:
            out["error"] = str(error)
    return out


def test_a_process_pool_program_runs_unchanged():
    expected = ppe_style_program(concurrent.futures.ProcessPoolExecutor, mp_context=multiprocessing.get_context("fork"))
    assert ppe_style_program(callreg.Executor) == expected
    assert expected["error"] == "bad item 3"


def test_submit_registers_each_callable_once():
    offset = 100
    with callreg.Executor(2) as ex:
        assert isinstance(ex, concurrent.futures.Executor)
        closure = lambda x: x + offset  # noqa: E731
        assert [ex.submit(closure, i).result() for i in range(5)] == [100, 101, 102, 103, 104]
        # A lambda built anew each time: one hashid, one registration.
        for i in range(3):
            assert ex.submit(lambda x: x * 2, i).result() == 2 * i
        installed = ex.worker.inspect()["targets"]
        assert sorted(len(table["installed"]) for table in installed.values()) == [2, 2]
    assert ex.worker.targets == []


def test_every_keyword_goes_to_the_function():
    with callreg.Executor(1) as ex:
        assert ex.submit(keywords, 1, target=7, timeout=2).result() == (1, 7, 2)


def test_the_least_recently_used_callable_is_unregistered_to_make_room():
    with callreg.Executor(1, slot_capacity=2) as ex:
        functions = [lambda x, k=k: x + k for k in range(5)]
        for _ in range(2):
            assert [ex.submit(f, 10).result() for f in functions] == [10, 11, 12, 13, 14]
        table = ex.worker.inspect()["targets"][0]
        assert len(table["installed"]) == 2


def test_chunked_map_matches_map_for_every_chunksize():
    with callreg.Executor(2) as ex:
        for chunksize in (1, 2, 7, 100, 1000):
            assert list(ex.map(cube, range(101), chunksize=chunksize)) == [i**3 for i in range(101)]
        assert list(ex.map(cube, [], chunksize=5)) == []
        with pytest.raises(ValueError, match="chunksize must be >= 1, got 0"):
            ex.map(cube, range(3), chunksize=0)
        # A call that raises fails its chunk; the chunks before it are there.
        results = ex.map(fails_at, range(10), [7] * 10, chunksize=3)
        assert [next(results) for _ in range(6)] == [0, 1, 2, 3, 4, 5]
        with pytest.raises(ValueError, match="bad item 7"):
            next(results)
        # Worker.map takes chunksize too.
        h = ex.worker.register(cube)
        assert list(ex.worker.map(h, range(10), chunksize=4)) == [i**3 for i in range(10)]


def test_map_timeout():
    with callreg.Executor(1) as ex:
        results = ex.map(slow, [1, 2], [0.0, 2.0], timeout=0.3)
        assert next(results) == 1
        with pytest.raises(concurrent.futures.TimeoutError):
            next(results)


_RAN = []  # in a target: the items `_record` ran with


def _record(x):
    _RAN.append(x)
    return x


def _ran():
    return list(_RAN)


def test_map_timeout_cancels_the_task_it_timed_out_on_too():
    # As concurrent.futures does: the item whose wait timed out is
    # cancelled with those after it, so no item of the map runs once it
    # raised. Before, the first item ran after the timeout.
    with callreg.Worker(1) as w:
        w.start()
        busy = w.submit(w.register(slow), 1, 1.0)
        with pytest.raises(concurrent.futures.TimeoutError):
            list(w.map(w.register(_record), range(3), timeout=0.3))
        assert busy.result(timeout=20) == 1
        assert w.call(w.register(_ran)) == []


def test_initializer_runs_in_every_target_and_replacement():
    with callreg.Executor(2, initializer=initialize, initargs=("ready",)) as ex:
        h = ex.worker.register(initialized)
        first = ex.worker.call_all(h)
        assert {t: value[0] for t, value in first.items()} == {0: "ready", 1: "ready"}
        assert {t: value[1] for t, value in first.items()} == {t: ex.worker.target_pid(t) for t in (0, 1)}
        old = ex.worker.target_pid(0)
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while ex.worker.target_incarnation(0) == 0 or ex.worker.target_phase(0) != "joined":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        value, pid = ex.worker.call(h, target=0)
        assert (value, pid) == ("ready", ex.worker.target_pid(0))
        assert pid != old


def test_a_failing_initializer_fails_the_start(capfd):
    def broken():
        raise RuntimeError("no init")

    with pytest.raises(callreg.TargetLostError) as info:
        callreg.Executor(1, initializer=broken, respawn_limit=0)
    # The error says why, with the initializer's innermost frames.
    outcome = info.value.outcomes[0]
    assert outcome.startswith(
        "failed (TARGET_LOST: the target could not start: RuntimeError: the target initializer failed: no init\n"
        "Traceback (most recent call last):\n"
    ), outcome
    assert 'raise RuntimeError("no init")' in outcome
    # The traceback is on the target's stderr too.
    assert "RuntimeError: no init" in capfd.readouterr().err


def _fails_once_marked(marker):
    if os.path.exists(marker):
        raise RuntimeError("marked")


def test_a_replacement_whose_initializer_raises_is_lost_with_the_reason(tmp_path):
    marker = str(tmp_path / "marker")
    with callreg.Executor(1, initializer=_fails_once_marked, initargs=(marker,), respawn_limit=1) as ex:
        open(marker, "w").close()
        os.kill(ex.worker.target_pid(0), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not any(e["event"] == "abandoned" for e in ex.worker.target_events()):
            assert time.monotonic() < deadline, ex.worker.target_events()
            time.sleep(0.01)
        causes = [e["cause"] for e in ex.worker.target_events() if e["event"] == "lost"]
        assert len(causes) == 2, causes
        assert causes[1].startswith(
            "the target could not start: RuntimeError: the target initializer failed: marked\n"
            "Traceback (most recent call last):\n"
        ), causes[1]


def test_asyncio_run_in_executor():
    async def main(ex):
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(loop.run_in_executor(ex, cube, i) for i in range(8)))

    with callreg.Executor(2) as ex:
        assert asyncio.run(main(ex)) == [i**3 for i in range(8)]


def test_shutdown_waits_then_refuses():
    ex = callreg.Executor(2)
    futures = [ex.submit(slow, i, 0.2) for i in range(4)]
    ex.shutdown(wait=True)
    assert [f.result(timeout=0) for f in futures] == [0, 1, 2, 3]
    assert ex.worker.targets == []
    with pytest.raises(RuntimeError, match="cannot schedule new futures after shutdown"):
        ex.submit(cube, 1)
    with pytest.raises(RuntimeError, match="cannot schedule new futures after shutdown"):
        ex.map(cube, [1])
    ex.shutdown()  # idempotent


def test_shutdown_without_waiting_lets_the_tasks_finish():
    ex = callreg.Executor(1)
    future = ex.submit(slow, 5, 0.3)
    began = time.monotonic()
    ex.shutdown(wait=False)  # cancel_futures=True would cancel it before it starts
    assert time.monotonic() - began < 0.2
    assert future.result(timeout=10) == 5
    ex.shutdown(wait=True)
    assert ex.worker.targets == []


def test_many_threads_submit_new_callables_at_once():
    with callreg.Executor(2, slot_capacity=4) as ex:
        errors = []

        def run(k):
            try:
                for i in range(20):
                    assert ex.submit(lambda x, k=k: (x, k), i).result(timeout=10) == (i, k)
            except BaseException as error:  # reported below
                errors.append(error)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_workers must be greater than 0"):
        callreg.Executor(0)
    with pytest.raises(
        TypeError,
        match=r"^Executor got an unexpected keyword argument 'next_level' \(use a Worker for trees of Workers\); "
        r"its options are max_workers, mp_context, initializer, initargs, max_tasks_per_child and the Worker's: "
        r"control_timeout, ",
    ):
        callreg.Executor(1, next_level=callreg.NextLevel(1))
    with pytest.raises(TypeError, match=r"^Executor got an unexpected keyword argument 'max_worker'; its options"):
        callreg.Executor(1, max_worker=3)
    with pytest.raises(ValueError, match=r"^Executor's mp_context 'threads' has no callreg equivalent: use 'fork'"):
        callreg.Executor(1, mp_context="threads")
    with pytest.raises(TypeError, match=r"^Executor's mp_context must be a multiprocessing context or a start "):
        callreg.Executor(1, mp_context=3)
    with pytest.raises(ValueError, match=r"^Executor's mp_context \(fork\) and start_method='forkserver' disagree"):
        callreg.Executor(1, mp_context="fork", start_method="forkserver")
    with callreg.Executor(1) as ex:
        with pytest.raises(TypeError, match="submit\\(\\) takes a callable, not int"):
            ex.submit(3)

        async def coro():
            return 1

        with pytest.raises(TypeError, match="is an async function"):
            ex.submit(coro)


def test_a_worker_submit_of_a_callable_says_how():
    with callreg.Worker(1) as w:
        w.start()
        with pytest.raises(callreg.HandleError, match=r"register cube first \(h = w.register\(fn\)\)"):
            w.submit(cube, 1)


def test_the_version_is_the_installed_distributions():
    import importlib.metadata

    assert callreg.__version__ == importlib.metadata.version("callreg")


PPE_INITIALIZER_PROGRAM = """
import concurrent.futures, multiprocessing, sys
import callreg

TAG = None

def init(tag):
    global TAG
    TAG = tag

def get(x):
    return (TAG, x)

class Box:
    def __init__(self, v):
        self.v = v

def boxed(x):
    return Box(x)

if sys.argv[1] == "ppe":
    pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"), initializer=init, initargs=("hi",))
else:
    pool = callreg.Executor(2, initializer=init, initargs=("hi",))
with pool as ex:
    print(ex.submit(get, 1).result(), list(ex.map(get, [2, 3])), type(ex.submit(boxed, 4).result()) is Box)
"""


def test_the_initializer_globals_pattern_of_process_pools_works():
    # A module-level function of __main__ reads the module global its
    # initializer set in the target, as with ProcessPoolExecutor(fork).
    outputs = outputs_of(PPE_INITIALIZER_PROGRAM)
    assert outputs["callreg"] == outputs["ppe"] == "('hi', 1) [('hi', 2), ('hi', 3)] True\n"


def raises_os_error(kind):
    if kind == "file":
        raise FileNotFoundError(2, "No such file", "/x/y")
    raise OSError("just a message")


def exits():
    raise SystemExit(3)


def test_task_exceptions_print_pickle_and_copy_as_the_originals():
    import copy
    import pickle

    with callreg.Executor(1) as ex:
        for kind, text in (("file", "[Errno 2] No such file: '/x/y'"), ("plain", "just a message")):
            error = ex.submit(raises_os_error, kind).exception(timeout=10)
            assert type(error) is (FileNotFoundError if kind == "file" else OSError)
            assert str(error) == text
        error = ex.submit(raises_os_error, "file").exception(timeout=10)
        assert (error.errno, error.strerror, error.filename, error.filename2) == (2, "No such file", "/x/y", None)
        for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
            assert type(again) is FileNotFoundError
            assert str(again) == "[Errno 2] No such file: '/x/y'"
        zero = ex.submit(divmod, 1, 0).exception(timeout=10)
        assert type(pickle.loads(pickle.dumps(zero))) is ZeroDivisionError
        # A task's SystemExit is itself too, as ProcessPoolExecutor's.
        stopped = ex.submit(exits).exception(timeout=10)
        assert type(stopped) is SystemExit and stopped.code == 3
        assert stopped.__cause__.remote_type == "SystemExit"
        assert "<dynamic-code>" not in stopped.__cause__.text


def test_done_and_running_see_a_finished_task_without_a_wait():
    with callreg.Executor(1) as ex:
        futures = [ex.submit(abs, -i) for i in range(6)]
        deadline = time.monotonic() + 10
        while not all(f.done() for f in futures):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [f.running() for f in futures] == [False] * 6
        assert [f.result(timeout=0) for f in futures] == list(range(6))
        # One look once the result is there is enough.
        slow_one = ex.submit(time.sleep, 0.2)
        time.sleep(0.6)
        assert slow_one.done() and not slow_one.running()


def test_an_eviction_whose_finalizer_ends_every_target_waits_for_a_replacement(tmp_path):
    # Each new callable evicts the last (one slot); its finalizer ends the
    # targets, and the next register waits for a replacement to serve
    # instead of failing NO_LIVE_TARGET. In a child process: objects whose
    # finalizer exits must not reach this process's later targets.
    script = tmp_path / "evict.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, callreg
            PARENT = os.getpid()
            class ExitsWhenFreed:
                def __del__(self):
                    if os.getpid() != PARENT:
                        os._exit(3)
            def make():
                held = ExitsWhenFreed()
                return lambda x: (x, type(held).__name__)
            with callreg.Executor(2, slot_capacity=1) as ex:
                for i in range(5):
                    print(ex.submit(make(), i).result(), ex.submit(abs, -i).result())
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["(%d, 'ExitsWhenFreed') %d" % (i, i) for i in range(5)]


MAIN_BY_VALUE_PROGRAM = """
import collections
import callreg

square = lambda x: x * x

def make_adder(n):
    def add(x):
        return x + n
    return add

add5 = make_adder(5)

def wrap(fn):
    def inner(*a):
        return fn(*a)
    return inner

@wrap
def decorated(x):
    return x + 1

def f(x):
    return x

g = f

def f(x):
    return -x

Point = collections.namedtuple("Point", "x y")
P = Point
Made = type("Made", (), {"__call__": lambda self, x: x * 10})
M = Made

with callreg.Executor(2) as ex:
    print(ex.submit(square, 3).result(), ex.submit(add5, 3).result(), ex.submit(decorated, 1).result())
    print(ex.submit(g, 1).result(), ex.submit(f, 1).result(), tuple(ex.submit(P, 1, 2).result()))
    print(ex.submit(M(), 4).result(), callreg.hashid(g) != callreg.hashid(f))
"""


def test_main_objects_pickle_cannot_find_by_name_go_by_value():
    # A lambda, a closure, a decorator's wrapper, a function rebound before
    # its name was redefined and classes bound under another name are
    # callables of __main__ that pickle cannot find by their names: the
    # Executor pickles them by value, as Worker.register does.
    done = subprocess.run([sys.executable, "-c", MAIN_BY_VALUE_PROGRAM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["9 8 2", "1 -1 (1, 2)", "40 True"]


EXIT_PROGRAM = """
import sys, time, callreg
OUT = sys.argv[1]
def work(i):
    time.sleep(0.2)
    with open(OUT, "a") as f:
        f.write("%d\\n" % i)
    return i
ex = callreg.Executor(2)
futures = [ex.submit(work, i) for i in range(4)]
if sys.argv[2] == "nowait":
    ex.shutdown(wait=False)
elif sys.argv[2] == "map":
    results = ex.map(work, range(4, 6))
elif sys.argv[2] == "cancel":
    ex.shutdown(wait=False, cancel_futures=True)
elif sys.argv[2] == "fork":
    import os, warnings
    warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: a threaded fork
    child = os.fork()
    if child == 0:
        sys.exit(0)  # runs the exit hooks: waits for nothing of the parent's
    os.waitpid(child, 0)
"""


@pytest.mark.parametrize(
    ("mode", "written"),
    [("nowait", "0123"), ("none", "0123"), ("map", "012345"), ("cancel", "01"), ("fork", "0123")],
)
def test_interpreter_exit_waits_for_the_tasks_as_a_process_pool_does(tmp_path, mode, written):
    # A program that ends without shutting its Executor down, or after
    # shutdown(wait=False), has its tasks run to their end (the cancelled
    # ones never run), and leaves no process behind.
    script = tmp_path / "exit.py"
    script.write_text(EXIT_PROGRAM)
    out = tmp_path / "out.txt"
    run = subprocess.run([sys.executable, str(script), str(out), mode], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stderr) == (0, "")
    assert "".join(sorted(out.read_text().split())) == written


def test_an_executor_nobody_holds_runs_its_tasks_to_their_end():
    # As with ProcessPoolExecutor: a future keeps its Executor alive until
    # it is resolved, then lets it go (it closes when collected).
    import gc
    import weakref

    assert callreg.Executor(1).submit(abs, -10).result() == 10
    assert list(callreg.Executor(1).map(abs, range(-3, 0), chunksize=2)) == [3, 2, 1]
    # Nothing holds the Executor once its future is made: it is
    # collected, its task still runs to its end, then its Worker closes.
    ex = callreg.Executor(1)
    worker = ex.worker
    future = ex.submit(slow_abs, -4, 0.3)
    gone = weakref.ref(ex)
    del ex
    gc.collect()
    assert gone() is None
    assert future.result(timeout=10) == 4
    deadline = time.monotonic() + 10
    while worker.targets:
        assert time.monotonic() < deadline, worker
        time.sleep(0.01)
    assert repr(worker) == "<callreg.Worker of 1 target, closed>"


def slow_abs(x, seconds):
    time.sleep(seconds)
    return abs(x)


FORKED_WHILE_BUSY_PROGRAM = """
import os, signal, sys, threading, time
import callreg

class SlowToUnpickle:
    def __reduce__(self):
        return (SlowToUnpickle._make, ())

    @staticmethod
    def _make():
        time.sleep(1.5)
        return SlowToUnpickle()

    def __call__(self, x):
        return x + 1

def slow(seconds):
    time.sleep(seconds)
    return seconds

ex = callreg.Executor(1)
busy = ex.submit(slow, 1.0)
waiter = threading.Thread(target=busy.result)
waiter.start()
registering = threading.Thread(target=lambda: print("registered", ex.submit(SlowToUnpickle(), 1).result()))
registering.start()
time.sleep(0.3)  # a thread inside submit, holding the Executor's lock; another waiting on busy
pid = os.fork()
if pid == 0:
    signal.alarm(20)
    try:
        ex.submit(abs, -1)
    except callreg.LifecycleError as error:
        owner = "LIFECYCLE_INVALID: this Worker belongs to process %d;" % os.getppid()
        print("child refused:", str(error).startswith(owner), flush=True)
    sys.exit(0)  # interpreter exit waits for the inherited Executor
started = time.monotonic()
_, status = os.waitpid(pid, 0)
print("child exit:", os.waitstatus_to_exitcode(status), time.monotonic() - started < 10)
waiter.join()
registering.join()
print("parent:", busy.result(), ex.submit(abs, -2).result())
ex.shutdown()
"""


def test_an_executor_inherited_while_its_threads_were_busy_refuses_and_exits_at_once_in_the_child():
    # At the fork one thread of the parent is inside submit (registering a
    # callable, holding the Executor's lock) and another waits on a future:
    # in the child the Executor's submit raises, and the child's exit (which
    # waits for every Executor) does not wait for threads that are not
    # there (specs/python.md §3, "Forked children").
    done = subprocess.run(
        [sys.executable, "-c", FORKED_WHILE_BUSY_PROGRAM], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "child refused: True",
        "child exit: 0 True",
        "registered 2",
        "parent: 1.0 2",
    ]
