#!/usr/bin/env python3
"""Runs CPython's own ``test_concurrent_futures`` process-pool tests against
``callreg.Executor``, beside the same selection against
``ProcessPoolExecutor`` (PPE) as the control.

Run it with the interpreter whose suite it runs (its ``test`` package must
be installed: ``import test.test_concurrent_futures``), with callreg
importable (``PYTHONPATH=python``)::

    PYTHONPATH=python python python/tools/cpython_futures_suite.py
    PYTHONPATH=python python python/tools/cpython_futures_suite.py --executor callreg --start-method fork -k test_map

The suite is imported, never copied. For each start method it takes the
process-pool test classes of the suite (those made with
``ProcessPoolForkMixin``, ``ProcessPoolForkserverMixin`` or
``ProcessPoolSpawnMixin``: a package since 3.12, one module before) and
runs them as they are, for PPE; for callreg it runs a subclass of each
whose ``executor_type`` builds a ``callreg.Executor`` with the keywords the
tests give PPE (``max_workers``, ``mp_context``, ``initializer``,
``initargs``, ``max_tasks_per_child``). What the subclass changes besides
the executor:

* a test that reads PPE's private attributes (``executor._processes``,
  ``_executor_manager_thread``, ``_call_queue``, ``_broken``,
  ``_max_workers``, ...) or builds ``futures.ProcessPoolExecutor`` itself
  is skipped, with the attribute as its reason (a scan of each test
  method's source, plus :data:`HAND_EXCLUDED`);
* the scripts the shutdown tests run in a child interpreter import the
  executor by its name from ``concurrent.futures``: that import is
  redirected to this module's :func:`CallregExecutor` (and the child gets
  this ``PYTHONPATH``);
* ``_fail_on_deadlock`` (the deadlock tests' give-up path) closes the
  callreg Worker instead of terminating PPE's ``_processes``, and the time
  those tests wait for a crashed task is ``--deadlock-timeout`` at most.

Each executor and start method runs in a child process of its own (this
script with ``--child``), which writes one JSON line per test. A test that
runs longer than ``--test-timeout`` (and so a class or module fixture or
cleanup after it) ends that child with every thread's traceback
(``faulthandler``); the command names the test, fails it, and runs the
tests left in a new child. It prints, per start method::

    callreg fork: N passed, M failed, K skipped
    ProcessPoolExecutor fork: N passed, M failed, K skipped

then every callreg failure with PPE's outcome of the same test, and exits
1 when a callreg test failed that passed for PPE (with ``--executor
callreg``: that was not run, so every callreg failure counts) and matches
no pattern of :data:`EXPECTED_DIFFERENCES`, or when a child ended outside
a test (a hung or crashed fixture or cleanup).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import fnmatch
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tokenize
import traceback
import types
import unittest
import unittest.mock
from collections.abc import Callable, Iterable
from typing import IO, Any

START_METHODS = ("fork", "forkserver", "spawn")
EXECUTORS = ("callreg", "ppe")
LABELS = {"callreg": "callreg", "ppe": "ProcessPoolExecutor"}
SUITE_PACKAGE = "test.test_concurrent_futures"
_MIXINS = {"fork": "ProcessPoolForkMixin", "forkserver": "ProcessPoolForkserverMixin", "spawn": "ProcessPoolSpawnMixin"}

# Test id pattern (fnmatch, case-sensitive, on the ids this command prints:
# ``<suite module>.<suite class>.<test method>``) -> why callreg may fail
# it where PPE passes. Only what no executor other than PPE can pass.
EXPECTED_DIFFERENCES: dict[str, str] = {
    "*.test_python_finalization_error": (
        "mocks threading._start_joinable_thread so that the second thread ProcessPoolExecutor starts (its "
        "queue feeder) fails, and expects BrokenProcessPool from map(mul, [(2, 3)] * 10), whose calls are wrong "
        "on purpose (mul takes two arguments): an executor that starts no second Python thread there runs the "
        "calls, which raise TypeError"
    ),
}

# Test id pattern -> why it does not run for callreg, besides what the
# source scan finds (:func:`exclusions`).
HAND_EXCLUDED: dict[str, str] = {
    "*.test_traceback": (
        "checks that the cause is exactly concurrent.futures.process._RemoteTraceback, a private class of "
        "ProcessPoolExecutor's module; callreg's cause is callreg.RemoteTraceback, with the same .tb text "
        "(tests/test_executor_promises.py checks it)"
    ),
    "*.test_hang_gh83386": (
        "its script calls multiprocessing.set_start_method without importing multiprocessing (a NameError "
        "before any executor is built) whenever the test has a start method; ProcessPoolExecutor skips it "
        "(gh-83386)"
    ),
}

# PPE's private attributes (and ThreadPoolExecutor's ``_threads``): read
# anywhere in a test method, they exclude it for callreg.
PPE_PRIVATE = (
    "_processes",
    "_executor_manager_thread",
    "_executor_manager_thread_wakeup",
    "_call_queue",
    "_result_queue",
    "_work_ids",
    "_pending_work_items",
    "_mp_context",
    "_max_tasks_per_child",
    "_max_workers",
    "_broken",
    "_shutdown_thread",
    "_shutdown_lock",
    "_queue_count",
    "_idle_worker_semaphore",
    "_safe_to_dynamically_spawn_children",
    "_threads",
)
_KNOWN_PRIVATE = re.compile(r"\.(%s)\b" % "|".join(PPE_PRIVATE))
# Any private attribute read on what the tests call an executor.
_EXECUTOR_PRIVATE = re.compile(r"\b(?:executor|e|pool|workers|t)\.(_[A-Za-z]\w*)")
_OWN_PPE = re.compile(r"\bfutures\.ProcessPoolExecutor\s*\(")

# The prefix of the callreg subclasses' names (attributes of this module,
# made on demand: a forkserver target unpickles them by name).
CALLREG_PREFIX = "Callreg"
# The name the child interpreters of the shutdown tests import.
FACTORY_NAME = "CallregExecutor"

# The most a callreg deadlock test waits for a crashed task's future
# (seconds); main() sets it from --deadlock-timeout.
_deadlock_timeout = 60.0


# -- the suite -------------------------------------------------------------


def suite_modules() -> list[types.ModuleType]:
    """The suite's test modules: the package's ``test_*`` modules (3.12
    and later), or the one module (before)."""
    top = importlib.import_module(SUITE_PACKAGE)
    if not hasattr(top, "__path__"):
        return [top]
    names = sorted(info.name for info in pkgutil.iter_modules(top.__path__) if info.name.startswith("test_"))
    return [importlib.import_module("%s.%s" % (SUITE_PACKAGE, name)) for name in names]


def suite_util() -> types.ModuleType:
    """The module with the suite's mixins and ``setup_module``."""
    top = importlib.import_module(SUITE_PACKAGE)
    if hasattr(top, "__path__"):
        return importlib.import_module(SUITE_PACKAGE + ".util")
    return top


def suite_classes(start_method: str) -> list[type[unittest.TestCase]]:
    """The suite's test classes of ``start_method``'s process-pool mixin,
    in module then name order."""
    mixin = getattr(suite_util(), _MIXINS[start_method])
    found: list[type[unittest.TestCase]] = []
    for module in suite_modules():
        for name, obj in sorted(vars(module).items()):
            if (
                isinstance(obj, type)
                and issubclass(obj, unittest.TestCase)
                and issubclass(obj, mixin)
                and obj.__name__ == name
                and obj.__module__ == module.__name__
            ):
                found.append(obj)
    return found


def short_module(cls: type) -> str:
    return cls.__module__.rsplit(".", 1)[-1]


def test_key(cls: type, method: str) -> str:
    """The id this command gives a test: ``<module>.<class>.<method>``,
    the suite's class (the same for both executors)."""
    original = getattr(cls, "_cpython_suite_original", cls)
    return "%s.%s.%s" % (short_module(original), original.__name__, method)


def test_names(cls: type[unittest.TestCase]) -> list[str]:
    return list(unittest.TestLoader().getTestCaseNames(cls))


def _code_of(function: object) -> str:
    """``function``'s source without its comments."""
    try:
        source = inspect.getsource(function)  # type: ignore[arg-type]  # any object: errors are caught
    except (OSError, TypeError):
        return ""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return source
    return tokenize.untokenize(token for token in tokens if token.type != tokenize.COMMENT)


def exclusions(cls: type[unittest.TestCase]) -> dict[str, str]:
    """Test method name -> why it does not run for callreg, for the suite
    class ``cls``."""
    excluded: dict[str, str] = {}
    for name in test_names(cls):
        key = test_key(cls, name)
        reasons: list[str] = []
        for pattern, reason in HAND_EXCLUDED.items():
            if fnmatch.fnmatchcase(key, pattern):
                reasons.append(reason)
        source = _code_of(getattr(cls, name))
        attributes = sorted(set(_KNOWN_PRIVATE.findall(source)) | set(_EXECUTOR_PRIVATE.findall(source)))
        if attributes:
            reasons.append("reads ProcessPoolExecutor's private %s" % ", ".join(attributes))
        if _OWN_PPE.search(source):
            reasons.append("builds futures.ProcessPoolExecutor itself")
        if reasons:
            excluded[name] = "; ".join(reasons)
    return excluded


# -- callreg ---------------------------------------------------------------


def CallregExecutor(
    max_workers: int | None = None,
    mp_context: Any = None,
    initializer: Callable[..., object] | None = None,
    initargs: Iterable[Any] = (),
    **kwargs: Any,
) -> Any:
    """A ``callreg.Executor`` built as the tests build ProcessPoolExecutor:
    every keyword is passed on (``mp_context`` and ``max_tasks_per_child``
    too)."""
    callreg = importlib.import_module("callreg")
    options: dict[str, Any] = dict(kwargs)
    if mp_context is not None:
        options["mp_context"] = mp_context
    return callreg.Executor(max_workers=max_workers, initializer=initializer, initargs=initargs, **options)


def _child_pythonpath() -> str:
    """The ``PYTHONPATH`` of a shutdown test's child interpreter: this
    module's directory, callreg's, then the inherited one."""
    callreg = importlib.import_module("callreg")
    paths = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(str(callreg.__file__)))]
    inherited = os.environ.get("PYTHONPATH")
    if inherited:
        paths.append(inherited)
    return os.pathsep.join(paths)


def _redirected(assert_python: Callable[..., Any]) -> Callable[..., Any]:
    """``assert_python_ok`` (or ``_failure``) whose script imports the
    executor from this module instead of ``concurrent.futures``."""
    old = "from concurrent.futures import %s" % FACTORY_NAME
    new = "from %s import %s" % (__name__, FACTORY_NAME)

    def run(*args: Any, **env_vars: Any) -> Any:
        args = tuple(arg.replace(old, new) if isinstance(arg, str) else arg for arg in args)
        # An environment variable also turns off the child's isolated mode.
        env_vars.setdefault("PYTHONPATH", _child_pythonpath())
        return assert_python(*args, **env_vars)

    return run


class _CallregCase(unittest.TestCase):
    """What a callreg subclass of a suite class changes (first in its MRO)."""

    executor_type = staticmethod(CallregExecutor)
    _cpython_suite_original: type

    def setUp(self) -> None:
        module = sys.modules[self._cpython_suite_original.__module__]
        for name in ("assert_python_ok", "assert_python_failure"):
            if hasattr(module, name):
                patcher = unittest.mock.patch.object(module, name, _redirected(getattr(module, name)))
                patcher.start()
                self.addCleanup(patcher.stop)
        super().setUp()

    def _fail_on_deadlock(self, executor: Any) -> None:
        # The suite's, with the Worker closed where PPE's processes are
        # terminated.
        with tempfile.TemporaryFile(mode="w+") as f:
            faulthandler.dump_traceback(file=f)
            f.seek(0)
            tb = f.read()
        executor.worker.close()
        executor.shutdown(wait=True)
        print("\nTraceback:\n %s" % tb, file=sys.__stderr__)
        self.fail("Executor deadlock:\n\n%s" % tb)


def _skipping(reason: str) -> Callable[[Any], None]:
    @unittest.skip(reason)
    def excluded(self: Any) -> None:
        pass

    return excluded


def callreg_name(cls: type) -> str:
    return CALLREG_PREFIX + cls.__name__


def callreg_class(cls: type[unittest.TestCase]) -> type[unittest.TestCase]:
    """The callreg subclass of the suite class ``cls``."""
    name = callreg_name(cls)
    namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": name, "_cpython_suite_original": cls}
    for method, reason in exclusions(cls).items():
        namespace[method] = _skipping(reason)
    timeout = getattr(cls, "TIMEOUT", None)
    if isinstance(timeout, (int, float)) and hasattr(cls, "_fail_on_deadlock"):
        namespace["TIMEOUT"] = min(timeout, _deadlock_timeout)
    return type(name, (_CallregCase, cls), namespace)


_CALLREG_CLASSES: dict[str, type[unittest.TestCase]] = {}


def callreg_classes() -> dict[str, type[unittest.TestCase]]:
    """Every callreg subclass, by name (made once)."""
    if not _CALLREG_CLASSES:
        for method in START_METHODS:
            for cls in suite_classes(method):
                _CALLREG_CLASSES[callreg_name(cls)] = callreg_class(cls)
    return _CALLREG_CLASSES


def __getattr__(name: str) -> Any:
    # The callreg subclasses, by name: what pickle finds in a process that
    # imports this module fresh (a forkserver target unpickling a bound
    # classmethod of a test).
    if name.startswith(CALLREG_PREFIX):
        cls = callreg_classes().get(name)
        if cls is not None:
            return cls
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def setUpModule() -> None:
    """The suite's module fixture, for the callreg subclasses (whose module
    is this one)."""
    util = suite_util()
    setup = getattr(util, "setup_module", None) or getattr(util, "setUpModule", None)
    if setup is not None:
        setup()


# -- one run (the child) ---------------------------------------------------


class _Events:
    """The JSON lines a run writes: ``start`` and ``end`` per test, ``done``
    at its end."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115  # closed at exit
        self._lock = threading.Lock()

    def write(self, **event: Any) -> None:
        with self._lock:
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()


class _Watchdog:
    """Ends the process when one test runs longer than ``timeout`` seconds,
    with every thread's traceback (``faulthandler.dump_traceback_later``:
    its own C thread, as regrtest's ``--timeout``, so no Python thread is
    added to the process the tests fork); the test's name is the last
    ``start`` without an ``end`` in the events, which the command reports."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def arm(self, key: str) -> None:
        sys.stderr.flush()
        faulthandler.dump_traceback_later(self.timeout, exit=True)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()


def _formatted(err: Any) -> str:
    return "".join(traceback.format_exception(*err))


def _recording_result(events: _Events, watchdog: _Watchdog) -> type[unittest.TextTestResult]:
    class Recording(unittest.TextTestResult):
        """Writes each test's outcome: ``failed`` when it or a subtest
        failed or erred, else ``skipped`` when skipped, else ``passed``
        (an expected failure passes)."""

        outcomes: dict[str, tuple[str, str]]

        def _key(self, test: unittest.TestCase) -> str:
            method = getattr(test, "_testMethodName", None)
            if method is None:  # a module or class fixture's error
                return test.id()
            return test_key(type(test), method)

        def _note(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
            if not hasattr(self, "outcomes"):
                self.outcomes = {}
            key = self._key(test)
            rank = {"passed": 0, "skipped": 1, "failed": 2}
            before = self.outcomes.get(key)
            if before is None or rank[outcome] > rank[before[0]]:
                self.outcomes[key] = (outcome, detail)
            if getattr(test, "_testMethodName", None) is None:
                events.write(event="end", id=key, outcome=outcome, detail=detail)

        def startTest(self, test: unittest.TestCase) -> None:
            key = self._key(test)
            events.write(event="start", id=key)
            watchdog.arm(key)
            super().startTest(test)

        def stopTest(self, test: unittest.TestCase) -> None:
            super().stopTest(test)
            watchdog.disarm()
            key = self._key(test)
            outcome, detail = getattr(self, "outcomes", {}).get(key, ("passed", ""))
            events.write(event="end", id=key, outcome=outcome, detail=detail)
            # What runs next (class and module fixtures, their cleanups)
            # is watched as well.
            events.write(event="after", id=key)
            watchdog.arm(key)

        def addSuccess(self, test: unittest.TestCase) -> None:
            super().addSuccess(test)
            self._note(test, "passed")

        def addError(self, test: unittest.TestCase, err: Any) -> None:
            super().addError(test, err)
            self._note(test, "failed", _formatted(err))

        def addFailure(self, test: unittest.TestCase, err: Any) -> None:
            super().addFailure(test, err)
            self._note(test, "failed", _formatted(err))

        def addSkip(self, test: unittest.TestCase, reason: str) -> None:
            super().addSkip(test, reason)
            self._note(test, "skipped", reason)

        def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
            super().addExpectedFailure(test, err)
            self._note(test, "passed")

        def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
            super().addUnexpectedSuccess(test)
            self._note(test, "failed", "unexpected success")

        def addSubTest(self, test: unittest.TestCase, subtest: unittest.TestCase, err: Any) -> None:
            super().addSubTest(test, subtest, err)
            if err is not None:
                detail = "%s\n%s" % (subtest.id(), _formatted(err))
                self._note(test, "failed", detail)

    return Recording


def _matches(key: str, pattern: str | None) -> bool:
    """unittest's ``-k``: a pattern without ``*`` matches as ``*pattern*``."""
    if pattern is None:
        return True
    if "*" not in pattern:
        pattern = "*%s*" % pattern
    return fnmatch.fnmatchcase(key, pattern)


def selection(executor: str, start_method: str, pattern: str | None, omit: set[str]) -> unittest.TestSuite:
    suite = unittest.TestSuite()
    for cls in suite_classes(start_method):
        run_cls = callreg_classes()[callreg_name(cls)] if executor == "callreg" else cls
        for name in test_names(run_cls):
            key = test_key(cls, name)
            if _matches(key, pattern) and key not in omit:
                suite.addTest(run_cls(name))
    return suite


def run_child(args: argparse.Namespace) -> int:
    """Runs one executor's tests for one start method, writing their
    outcomes to ``args.results``."""
    global _deadlock_timeout
    _deadlock_timeout = args.deadlock_timeout
    support: Any = importlib.import_module("test.support")
    support.verbose = 0  # the suite's own timing prints
    (executor,) = args.executor
    (start_method,) = args.start_method
    events = _Events(args.results)
    omit: set[str] = set()
    if args.omit:
        with open(args.omit, encoding="utf-8") as f:
            omit = set(json.load(f))
    suite = selection(executor, start_method, args.k, omit)
    watchdog = _Watchdog(args.test_timeout)
    runner = unittest.TextTestRunner(
        stream=sys.stderr, verbosity=2 if args.verbose else 1, resultclass=_recording_result(events, watchdog)
    )
    runner.run(suite)
    watchdog.disarm()
    events.write(event="done")
    return 0


# -- the command -----------------------------------------------------------


class Run:
    """One child's outcomes."""

    def __init__(self, executor: str, start_method: str) -> None:
        self.executor = executor
        self.start_method = start_method
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.done = False
        self.returncode = 0
        self.seconds = 0.0
        # The tests a child ended in (each then run on by a new child).
        self.ended_in: list[str] = []
        # How children ended outside any test.
        self.aborts: list[str] = []

    def read(self, path: str, returncode: int) -> bool:
        """Takes one child's events; ``True`` when it ran to its end. A
        test it started and never ended (it hung, or the child crashed in
        it) fails."""
        started: list[str] = []
        after: str | None = None
        done = False
        with open(path, encoding="utf-8") as f:
            for line in f:
                event = json.loads(line)
                kind = event.pop("event")
                if kind == "start":
                    started.append(event["id"])
                elif kind == "after":
                    after = event["id"]
                elif kind == "end":
                    self.outcomes[event["id"]] = (event["outcome"], event["detail"])
                elif kind == "done":
                    done = True
        if not done:
            self.returncode = returncode
            left = [key for key in started if key not in self.outcomes]
            if left:
                self.ended_in.append(left[-1])
                self.outcomes[left[-1]] = (
                    "failed",
                    "the run ended in this test (exit code %d): a hang past --test-timeout or a crash; "
                    "every thread's traceback is in the run's output" % returncode,
                )
            else:
                self.aborts.append(
                    "a child ended (exit code %d) %s, in no test: a class or module fixture or cleanup hung "
                    "past --test-timeout or crashed (every thread's traceback is in the run's output)"
                    % (returncode, "after %s" % after if after else "before its first test")
                )
        return done

    def counts(self) -> str:
        tally = {"passed": 0, "failed": 0, "skipped": 0}
        for outcome, _ in self.outcomes.values():
            tally[outcome] += 1
        return "%s %s: %d passed, %d failed, %d skipped" % (
            LABELS[self.executor],
            self.start_method,
            tally["passed"],
            tally["failed"],
            tally["skipped"],
        )


# How many times a run goes on, in a new child, after one ended in a test.
MAX_RESUMES = 5


def run_one(args: argparse.Namespace, executor: str, start_method: str) -> Run:
    """Runs one executor's tests for one start method in a child; when the
    child ends in a test (a hang, a crash), a new one runs the tests not
    run yet."""
    run = Run(executor, start_method)
    with contextlib.ExitStack() as stack:
        output: IO[str] | None = None
        log = ""
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)
            log = os.path.join(args.log_dir, "%s-%s.log" % (executor, start_method))
            output = stack.enter_context(open(log, "w", encoding="utf-8"))
        print("== %s %s%s" % (LABELS[executor], start_method, " (log: %s)" % log if log else ""), flush=True)
        began = time.monotonic()
        for _ in range(MAX_RESUMES + 1):
            run.done, resumable = _run_child_once(args, run, output)
            if run.done or not resumable:
                break
        run.seconds = time.monotonic() - began
    return run


def _run_child_once(args: argparse.Namespace, run: Run, output: IO[str] | None) -> tuple[bool, bool]:
    """One child of ``run``, skipping the tests ``run`` has outcomes of:
    whether it ran to its end, and whether it ended in a test (a new child
    may go on after it)."""
    fd, path = tempfile.mkstemp(prefix="cpython-futures-", suffix=".jsonl")
    os.close(fd)
    fd, skip_path = tempfile.mkstemp(prefix="cpython-futures-skip-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(sorted(run.outcomes), f)
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--executor",
        run.executor,
        "--start-method",
        run.start_method,
        "--results",
        path,
        "--omit",
        skip_path,
        "--test-timeout",
        str(args.test_timeout),
        "--deadlock-timeout",
        str(args.deadlock_timeout),
    ]
    if args.k is not None:
        command += ["-k", args.k]
    if args.verbose:
        command.append("--verbose")
    try:
        if output is not None:
            output.flush()
        # A session of its own: what it leaves behind when it ends in a
        # test is killed with it.
        child = subprocess.Popen(command, stdout=output, stderr=output, start_new_session=True)
        try:
            returncode = child.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            returncode = child.wait()
        if returncode != 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
        known = len(run.outcomes)
        done = run.read(path, returncode)
        return done, not done and len(run.outcomes) > known
    finally:
        os.unlink(path)
        os.unlink(skip_path)


def expected_reason(key: str) -> str | None:
    for pattern, reason in EXPECTED_DIFFERENCES.items():
        if fnmatch.fnmatchcase(key, pattern):
            return reason
    return None


def _summary(detail: str) -> str:
    """The error of a traceback: the first unindented line after its last
    ``Traceback`` header (the detail's first line when it has none)."""
    lines = detail.strip().splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    line = lines[0] if lines else ""
    if headers:
        for candidate in lines[headers[-1] + 1 :]:
            if candidate and not candidate[0].isspace():
                line = candidate
                break
    return line if len(line) <= 240 else line[:237] + "..."


def report(runs: list[Run], executors: list[str]) -> int:
    """Prints the counts and callreg's failures; the exit status."""
    status = 0
    print()
    for run in runs:
        print(run.counts())
    print()
    for run in runs:
        note = " (a child ended in %s)" % ", ".join(run.ended_in) if run.ended_in else ""
        if not run.done:
            note += " (did not finish: exit code %d)" % run.returncode
        print("wall time %s %s: %.1f s%s" % (LABELS[run.executor], run.start_method, run.seconds, note))
        for abort in run.aborts:
            print("    %s" % abort)
        if not run.done or run.aborts:
            status = 1
    by_method = {(run.executor, run.start_method): run for run in runs}
    for run in runs:
        if run.executor != "callreg":
            continue
        control = by_method.get(("ppe", run.start_method))
        failed = sorted(key for key, (outcome, _) in run.outcomes.items() if outcome == "failed")
        if not failed:
            continue
        print("\ncallreg %s failures:" % run.start_method)
        for key in failed:
            ppe = control.outcomes.get(key, ("not run", ""))[0] if control is not None else "not run"
            reason = expected_reason(key)
            if ppe == "passed" or control is None:
                mark = "EXPECTED (%s)" % reason if reason else "NEW"
                if reason is None:
                    status = 1
            else:
                mark = "PPE %s" % ppe
            print("  [%s] %s\n      %s" % (mark, key, _summary(run.outcomes[key][1])))
    if "ppe" not in executors and any(run.executor == "callreg" for run in runs):
        print("\n(no PPE control run: every callreg failure not in EXPECTED_DIFFERENCES counts)")
    return status


def list_expected(start_methods: list[str]) -> None:
    print("EXPECTED_DIFFERENCES (callreg failures accepted where PPE passes):")
    if not EXPECTED_DIFFERENCES:
        print("  (none)")
    for pattern, reason in EXPECTED_DIFFERENCES.items():
        print("  %s\n      %s" % (pattern, reason))
    print("\nExcluded for callreg (skipped, with the reason):")
    for method in start_methods:
        for cls in suite_classes(method):
            for name, reason in exclusions(cls).items():
                print("  %s\n      %s" % (test_key(cls, name), reason))


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--executor", choices=(*EXECUTORS, "both"), default="both")
    parser.add_argument("--start-method", choices=START_METHODS, action="append", dest="start_method")
    parser.add_argument("-k", help="run only the test ids that match (unittest's -k: fnmatch, *k* without a *)")
    parser.add_argument("--list-expected", action="store_true", help="print the expected differences and exclusions")
    parser.add_argument("--test-timeout", type=float, default=420.0, help="seconds one test may run (default 420)")
    parser.add_argument(
        "--deadlock-timeout",
        type=float,
        default=60.0,
        help="the most callreg's deadlock tests wait for a crashed task (seconds, default 60; PPE keeps the suite's)",
    )
    parser.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one run may take (default 3600)")
    parser.add_argument("--log-dir", help="write each run's output to <dir>/<executor>-<start method>.log")
    parser.add_argument("--verbose", "-v", action="store_true", help="name each test as it runs")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--omit", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.start_method = args.start_method or list(START_METHODS)
    args.executor = list(EXECUTORS) if args.executor == "both" else [args.executor]
    if args.child and (len(args.executor) != 1 or len(args.start_method) != 1 or not args.results):
        parser.error("--child runs one executor and one start method into --results")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        return run_child(args)
    if args.list_expected:
        list_expected(args.start_method)
        return 0
    runs = [run_one(args, executor, method) for method in args.start_method for executor in args.executor]
    return report(runs, args.executor)


if __name__ == "__main__":
    # Run as this module (not __main__): the callreg subclasses are its
    # attributes, found by that name in a forkserver target.
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    sys.exit(importlib.import_module("cpython_futures_suite").main())
