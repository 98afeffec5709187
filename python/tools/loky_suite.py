#!/usr/bin/env python3
"""Runs loky's own ``ProcessPoolExecutor`` tests against
``callreg.Executor``, beside the same selection against loky's
``ProcessPoolExecutor`` as the control.

loky's tests are in its source distribution, not in its wheel. Give the
unpacked sdist (or its ``.tar.gz``), or a cache directory this command
downloads it into (``pip download --no-binary :all: loky==3.7.0``, then
unpacked there), with loky and pytest installed and callreg importable
(``PYTHONPATH=python``)::

    PYTHONPATH=python python python/tools/loky_suite.py --cache target/loky-sdist
    PYTHONPATH=python python python/tools/loky_suite.py --sdist loky-3.7.0 --executor callreg --start-method loky -k test_map

The suite is imported, never copied: pytest runs loky's
``tests/test_process_executor_<method>.py`` for the start methods
``loky``, ``forkserver`` and ``spawn`` (the generic tests of
``tests/_test_process_executor.py`` with loky's ``context`` of that
name), from the sdist's root, so that they import as loky's own runs
import them (the package ``tests``), with loky's ``conftest.py`` and
pytest settings. Its other modules test loky's reusable executor
(``get_reusable_executor``), its process backend, resource tracker and
helpers: loky-only, not run. This module is also the pytest plugin of those runs
(``-p loky_suite``). For loky it only records the outcomes; for callreg it
puts in each test module, under the suite class's name, a subclass of it
(an attribute of this module: a target unpickles it by name) whose
``executor_type`` is :func:`CallregExecutor`: a ``callreg.Executor`` built
from the keywords the tests give loky (``max_workers``, ``context``,
``initializer``, ``initargs``). loky's ``context`` ``loky`` (a fresh
interpreter per worker, loky's default) becomes callreg's default start
method, ``fork`` (what a loky program gets from ``callreg.Executor(n)``);
``forkserver`` and ``spawn`` are passed on (callreg runs ``spawn`` as
``forkserver``). What the subclass changes besides the executor:

* loky's per-test fixtures read loky's private ``_processes`` and
  ``_flags`` (its count of worker processes, its broken flag): the
  subclass's own build the executor with the same keywords, check that
  it runs a task, and at the end shut it down (``kill_workers=True`` for a
  test marked ``broken_pool``) and check that it took less than 10 s and
  left no process behind; the check of a process count
  (``_check_subprocesses_number``) counts the processes started since the
  test began, not the executor's ``_processes``;
* the event the suite shares with the workers (passed in ``initargs``) is
  a ``multiprocessing.Manager().Event()`` under ``forkserver`` and
  ``spawn``: callreg pickles ``initargs`` into its fork server, where a
  ``multiprocessing`` Event cannot travel (it only passes to a process
  being started), and names a Manager proxy as the way (under ``fork``
  the targets inherit the suite's own Event);
* the scripts the shutdown tests run in a child interpreter import the
  executor by its name from ``loky.process_executor``: that import is
  redirected to this module's :func:`CallregExecutor`;
* a test that reads loky's private attributes (``executor._processes``,
  ``_executor_manager_thread``, ``_call_queue``, ``_flags``,
  ``process_executor._RemoteTraceback``, ...), passes loky-only keywords
  to the executor (``timeout``, ``job_reducers``, ``result_reducers``,
  ``env``) or tests a loky-only feature (``LokyRecursionError``,
  ``get_reusable_executor``) is skipped, with the reason (a scan of each
  test method's source, plus :data:`HAND_EXCLUDED`). The control skips
  the same tests (``--full-control`` runs them for loky).

Each executor and start method runs in a pytest process of its own, which
writes one JSON line per test. A test that runs longer than
``--test-timeout`` (fixtures and cleanups included) ends that process
with every thread's traceback (``faulthandler``); the command names the
test, fails it, and runs the tests left in a new process. It prints, per
start method::

    callreg loky: N passed, M failed, K skipped
    loky loky: N passed, M failed, K skipped

then every callreg failure with loky's outcome of the same test, and
exits 1 when a callreg test failed that passed for loky (with ``--executor
callreg``: that was not run, so every callreg failure counts) and matches
no pattern of :data:`EXPECTED_DIFFERENCES`, or when a run ended outside a
test (a hung or crashed fixture, or an error collecting the suite).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import faulthandler
import fnmatch
import importlib
import inspect
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import threading
import time
import tokenize
import types
from collections.abc import Callable, Iterable
from typing import IO, Any

# The loky release whose tests run (its sdist's tests/).
LOKY_VERSION = "3.7.0"
START_METHODS = ("loky", "forkserver", "spawn")
EXECUTORS = ("callreg", "loky")
# loky's start method -> the mp_context callreg.Executor gets.
CALLREG_START_METHODS = {
    "loky": "fork",
    "loky_init_main": "fork",
    "fork": "fork",
    "forkserver": "forkserver",
    "spawn": "spawn",
}
# The name the test modules have in the suite package ``tests``.
SUITE_PACKAGE = "tests"
# The suite's module of the generic tests (the one the child scripts of
# its shutdown tests import).
GENERIC_MODULE = SUITE_PACKAGE + "._test_process_executor"
MIXIN_MODULE = SUITE_PACKAGE + "._executor_mixin"

# Test id pattern (fnmatch, case-sensitive, on the ids this command prints:
# ``<suite module>.<suite class>.<test method>[<parameters>]``) -> why
# callreg may fail it where loky passes.
EXPECTED_DIFFERENCES: dict[str, str] = {
    "*.test_exited_child": (
        "a worker that exits in a task breaks loky's whole pool (that task and every later submit raise "
        "TerminatedWorkerError naming EXIT(42)); callreg fails that task with TargetLostError (a "
        "BrokenProcessPool) and replaces the target, so later submits run"
    ),
    "*.test_shutdown_with_sys_exit_at_pickle": (
        "an argument whose __reduce__ calls exit(): callreg pickles the arguments in submit, in the caller's "
        "thread, where the SystemExit propagates as any BaseException does (only an Exception fails the "
        "future); loky pickles in its feeder thread and fails the future with PicklingError"
    ),
    "*.test_shutdown_and_kill_workers": (
        "a task running when shutdown(kill_workers=True) stops the targets fails with callreg.LifecycleError; "
        "loky raises its own ShutdownExecutorError (a RuntimeError), which the test requires"
    ),
    "*.test_no_failure_on_large_data_send": (
        "(runs with --high-memory only) sends one 2.2 GB argument; a callreg task's pickled input is at most "
        "max_frame_bytes (256 MiB by default), so it fails with FRAME_INVALID"
    ),
}

# Test id pattern -> why it does not run for callreg, besides what the
# source scan finds (:func:`exclusions`).
HAND_EXCLUDED: dict[str, str] = {
    "*.test_traceback": (
        "checks that the cause is exactly loky.process_executor._RemoteTraceback, a private class of loky; "
        "callreg's cause is callreg.RemoteTraceback, with the same .tb text"
    ),
    "*.test_memory_leak_protection": (
        "loky's workers watch their own memory and restart past a leak: a loky-only feature"
    ),
    "*.test_reference_cycle_collection": (
        "checks the garbage collection loky's workers run between tasks with their memory-leak watch: a "
        "loky-only feature"
    ),
    "*.test_viztracer_profiler*": (
        "loky starts viztracer in its workers when this process traces with it: a loky-only feature"
    ),
}

# loky's private attributes: read anywhere in a test method, they exclude
# it for callreg.
LOKY_PRIVATE = (
    "_processes",
    "_executor_manager_thread",
    "_executor_manager_thread_wakeup",
    "_call_queue",
    "_result_queue",
    "_flags",
    "_running_work_items",
    "_pending_work_items",
    "_work_ids",
    "_processes_management_lock",
    "_context",
    "_max_workers",
    "_shutdown_lock",
    "_idle_worker_semaphore",
)
_KNOWN_PRIVATE = re.compile(r"\.(%s)\b" % "|".join(LOKY_PRIVATE))
# Any private attribute read on what the tests call an executor, and
# loky's module-level private names.
_EXECUTOR_PRIVATE = re.compile(r"\b(?:executor|e)\.(_[A-Za-z]\w*)")
_MODULE_PRIVATE = re.compile(r"\bprocess_executor\.(_[A-Za-z]\w*)")
# loky-only names: a test that uses one tests a loky-only feature.
LOKY_ONLY_NAMES = {
    "LokyRecursionError": "loky's limit on nested executors (LokyRecursionError, MAX_DEPTH)",
    "get_reusable_executor": "loky's reusable executor",
}
# Keywords of loky's ProcessPoolExecutor that callreg.Executor has no
# equivalent of -> what they do.
LOKY_ONLY_KEYWORDS = {
    "timeout": "idle workers exit after timeout seconds",
    "job_reducers": "custom reducers for the tasks",
    "result_reducers": "custom reducers for the results",
    "env": "environment variables of the workers",
}

# The prefix of the callreg subclasses' names (attributes of this module,
# made on demand: a target unpickles them by name).
CALLREG_PREFIX = "Callreg"
# The name the child interpreters of the shutdown tests import.
FACTORY_NAME = "CallregExecutor"


# -- the sdist -------------------------------------------------------------


def sdist_root(args: argparse.Namespace) -> str:
    """The unpacked sdist's directory (with ``tests/``): ``--sdist`` (a
    directory or a ``.tar.gz``, unpacked next to it), or the one in
    ``--cache``, downloaded and unpacked there when missing."""
    if args.sdist:
        path = os.path.abspath(args.sdist)
        if os.path.isfile(path):
            return _unpacked(path, os.path.dirname(path))
        return _checked(path)
    cache = os.path.abspath(args.cache)
    root = os.path.join(cache, "loky-%s" % LOKY_VERSION)
    if os.path.isfile(os.path.join(root, "tests", "_test_process_executor.py")):
        return _checked(root)
    os.makedirs(cache, exist_ok=True)
    archive = os.path.join(cache, "loky-%s.tar.gz" % LOKY_VERSION)
    if not os.path.isfile(archive):
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
        command += ["--no-binary", ":all:", "--no-deps", "loky==%s" % LOKY_VERSION, "-d", cache]
        print("downloading loky %s's sdist into %s" % (LOKY_VERSION, cache), flush=True)
        if subprocess.run(command, check=False).returncode != 0 or not os.path.isfile(archive):
            sys.exit(
                "pip download of loky==%s's sdist into %s failed: check the network access to PyPI, or give "
                "an unpacked sdist with --sdist" % (LOKY_VERSION, cache)
            )
    return _unpacked(archive, cache)


def _unpacked(archive: str, into: str) -> str:
    root = os.path.join(into, "loky-%s" % LOKY_VERSION)
    if not os.path.isfile(os.path.join(root, "tests", "_test_process_executor.py")):
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(into, filter="data")
            else:  # pragma: no cover - interpreters without PEP 706
                tar.extractall(into)  # noqa: S202  # PyPI's sdist of a pinned release
    return _checked(root)


def _checked(root: str) -> str:
    """``root`` when it is loky's sdist of :data:`LOKY_VERSION`; else exits
    naming what to give."""
    tests = os.path.join(root, "tests", "_test_process_executor.py")
    if not os.path.isfile(tests):
        sys.exit(
            "%s is not an unpacked loky sdist (no tests/_test_process_executor.py): give the directory "
            "loky-%s of `pip download --no-binary :all: --no-deps loky==%s`, or --cache DIR"
            % (root, LOKY_VERSION, LOKY_VERSION)
        )
    version = ""
    with contextlib.suppress(OSError), open(os.path.join(root, "PKG-INFO"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("Version:"):
                version = line.split(":", 1)[1].strip()
                break
    if version != LOKY_VERSION:
        sys.exit(
            "%s is loky %s's sdist, not %s's: this command's lists are for %s (pip download --no-binary "
            ":all: --no-deps loky==%s)"
            % (root, version or "an unknown version", LOKY_VERSION, LOKY_VERSION, LOKY_VERSION)
        )
    return root


def _pythonpath(root: str) -> str:
    """The ``PYTHONPATH`` of a run: the sdist's root (its package
    ``tests``), this module's directory, callreg's, then the inherited
    one."""
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [root, here]
    with contextlib.suppress(ImportError):
        callreg = importlib.import_module("callreg")
        paths.append(os.path.dirname(os.path.dirname(str(callreg.__file__))))
    inherited = os.environ.get("PYTHONPATH")
    if inherited:
        paths.append(inherited)
    return os.pathsep.join(paths)


# -- the suite -------------------------------------------------------------


def suite_module(start_method: str) -> types.ModuleType:
    return importlib.import_module("%s.test_process_executor_%s" % (SUITE_PACKAGE, start_method))


def suite_classes(start_method: str) -> list[type]:
    """The test classes of ``start_method``'s module (loky's executor mixin
    and a test class of ``_test_process_executor``), by name."""
    module = suite_module(start_method)
    mixin = importlib.import_module(MIXIN_MODULE).ExecutorMixin
    found = []
    for name, obj in sorted(vars(module).items()):
        original = getattr(obj, "_loky_suite_original", obj)
        if isinstance(original, type) and issubclass(original, mixin) and name.startswith("Test"):
            found.append(original)
    return found


def key_of(nodeid: str) -> str:
    """The id this command gives the pytest test ``nodeid``:
    ``<module>.<class>.<method>[<parameters>]`` (the same for both
    executors)."""
    parts = nodeid.split("::")
    module = os.path.splitext(os.path.basename(parts[0]))[0]
    return ".".join([module, *parts[1:]])


def _code_of(function: object) -> str:
    """``function``'s source without its comments, dedented."""
    try:
        source = textwrap.dedent(inspect.getsource(function))  # type: ignore[arg-type]  # any object: errors are caught
    except (OSError, TypeError):
        return ""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return source
    return tokenize.untokenize(token for token in tokens if token.type != tokenize.COMMENT)


def _loky_only_keywords(source: str) -> list[str]:
    """The loky-only keywords given to ``executor_type(...)`` in
    ``source``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "executor_type":
            found.update(k.arg for k in node.keywords if k.arg in LOKY_ONLY_KEYWORDS)
    return sorted(found)


def exclusions(cls: type, start_method: str) -> dict[str, str]:
    """Test method name -> why it does not run for callreg, for the suite
    class ``cls`` of ``start_method``'s module."""
    excluded: dict[str, str] = {}
    module = "test_process_executor_%s" % start_method
    for name in sorted(dir(cls)):
        if not name.startswith("test"):
            continue
        function = getattr(cls, name)
        if not callable(function):
            continue
        key = "%s.%s.%s" % (module, cls.__name__, name)
        reasons = [reason for pattern, reason in HAND_EXCLUDED.items() if fnmatch.fnmatchcase(key, pattern)]
        source = _code_of(function)
        attributes = sorted(set(_KNOWN_PRIVATE.findall(source)) | set(_EXECUTOR_PRIVATE.findall(source)))
        if attributes:
            reasons.append("reads loky's private executor attributes %s" % ", ".join(attributes))
        module_private = sorted(set(_MODULE_PRIVATE.findall(source)))
        if module_private:
            reasons.append("uses loky's private %s" % ", ".join("process_executor." + a for a in module_private))
        keywords = _loky_only_keywords(source)
        if keywords:
            reasons.append(
                "builds the executor with loky-only keywords, which callreg.Executor has no equivalent of: %s"
                % "; ".join("%s (%s)" % (k, LOKY_ONLY_KEYWORDS[k]) for k in keywords)
            )
        for word, feature in LOKY_ONLY_NAMES.items():
            if re.search(r"\b%s\b" % word, source):
                reasons.append("tests %s, a loky-only feature" % feature)
        if reasons:
            excluded[name] = "; ".join(reasons)
    return excluded


# -- callreg ---------------------------------------------------------------


def CallregExecutor(
    max_workers: int | None = None,
    *,
    context: Any = None,
    initializer: Callable[..., object] | None = None,
    initargs: Iterable[Any] = (),
    **loky_only: Any,
) -> Any:
    """A ``callreg.Executor`` built as the tests build loky's
    ``ProcessPoolExecutor``: ``max_workers``, ``initializer`` and
    ``initargs`` as they are, loky's ``context`` as ``mp_context`` (see
    :data:`CALLREG_START_METHODS`). Raises ``TypeError`` for loky's
    keywords that callreg has no equivalent of (the tests that give them
    are excluded)."""
    given = sorted(name for name, value in loky_only.items() if value is not None)
    if given:
        raise TypeError(
            "loky's ProcessPoolExecutor keyword %s has no callreg.Executor equivalent: exclude the test (%s)"
            % (", ".join(given), os.path.basename(__file__))
        )
    callreg = importlib.import_module("callreg")
    options: dict[str, Any] = {}
    if context is not None:
        options["mp_context"] = callreg_start_method(context)
    return callreg.Executor(max_workers=max_workers, initializer=initializer, initargs=initargs, **options)


def callreg_start_method(context: Any) -> str:
    """The mp_context callreg gets for loky's ``context`` (a context or a
    start method's name)."""
    name = context if isinstance(context, str) else context.get_start_method()
    try:
        return CALLREG_START_METHODS[name]
    except KeyError:
        raise ValueError(
            "loky's context %r has no callreg start method in %s: add it to CALLREG_START_METHODS"
            % (name, os.path.basename(__file__))
        ) from None


def _redirected(check_subprocess_call: Callable[..., Any]) -> Callable[..., Any]:
    """The suite's ``check_subprocess_call`` whose ``python -c`` script
    imports the executor from this module instead of
    ``loky.process_executor``."""
    old = "from loky.process_executor import %s" % FACTORY_NAME
    new = "from %s import %s" % (__name__, FACTORY_NAME)

    def run(cmd: list[str], *args: Any, **kwargs: Any) -> Any:
        cmd = [part.replace(old, new) for part in cmd]
        return check_subprocess_call(cmd, *args, **kwargs)

    return run


# The processes (pids) that were this process's descendants when the
# running test's setup began: not the test's.
_before_test: set[int] = set()


def _descendants() -> set[int]:
    """This process's descendants (none known without psutil: loky's
    process checks are then skipped as well)."""
    try:
        psutil = importlib.import_module("psutil")
    except ImportError:
        return set()
    return {child.pid for child in psutil.Process().children(recursive=True)}


def _test_processes_only(find: Callable[[Any], list[tuple[int, str]]]) -> Callable[[Any], list[tuple[int, str]]]:
    """The suite's ``_running_children_pids_with_cmdline`` without the
    processes alive before the test (the Manager of the shared event, a
    fork server of an earlier test's ``multiprocessing`` use)."""

    def found(process: Any) -> list[tuple[int, str]]:
        return [(pid, cmdline) for pid, cmdline in find(process) if pid not in _before_test]

    return found


def _counting_test_processes(check: Callable[..., Any]) -> Callable[..., Any]:
    """The suite's ``_check_subprocesses_number``, which reads loky's
    ``executor._processes`` when given an executor: with a callreg
    Executor, it counts the processes the test started instead."""

    def count(executor: Any = None, *args: Any, **kwargs: Any) -> Any:
        if executor is not None and not hasattr(executor, "_processes"):
            executor = None
        return check(executor, *args, **kwargs)

    return count


_CALLREG_CASE: list[type] = []


def callreg_case() -> type:
    """What a callreg subclass of a suite class changes (first in its MRO):
    made once, at first use (it needs pytest)."""
    if _CALLREG_CASE:
        return _CALLREG_CASE[0]
    pytest: Any = importlib.import_module("pytest")
    mixin: Any = importlib.import_module(MIXIN_MODULE)

    class _CallregCase:
        executor_type = staticmethod(CallregExecutor)
        worker_count: int
        context: Any
        executor: Any
        _loky_suite_manager: Any = None

        @classmethod
        def setup_class(cls) -> None:
            if callreg_start_method(cls.context) == "fork":
                mixin._test_event = cls.context.Event()
            else:
                # callreg pickles initargs into its fork server: a Manager
                # proxy travels there, a multiprocessing Event does not.
                import multiprocessing

                cls._loky_suite_manager = multiprocessing.get_context("spawn").Manager()
                mixin._test_event = cls._loky_suite_manager.Event()

        @classmethod
        def teardown_class(cls) -> None:
            mixin._test_event = None
            if cls._loky_suite_manager is not None:
                cls._loky_suite_manager.shutdown()
                cls._loky_suite_manager = None

        @pytest.fixture(autouse=True)  # type: ignore[untyped-decorator]  # pytest's own
        def setup_method(self) -> None:
            # loky's, without its count of the executor's _processes.
            _before_test.clear()
            _before_test.update(_descendants())
            assert mixin._test_event is not None
            self.executor = self.executor_type(
                max_workers=self.worker_count,
                context=self.context,
                initializer=mixin.initializer_event,
                initargs=(mixin._test_event,),
            )
            assert self.executor.submit(id, None).result(timeout=mixin.TIMEOUT) is not None

        def teardown_method(self, method: Any) -> None:
            # loky's, without its check of the private broken flag (a
            # callreg Executor has none: a lost target is replaced).
            executor = getattr(self, "executor", None)
            if executor is None:
                return
            broken = any(mark.name == "broken_pool" for mark in getattr(method, "pytestmark", []))
            began = time.time()
            executor.shutdown(wait=True, kill_workers=broken)
            assert time.time() - began < 10, "Executor took too long to shutdown"
            mixin._check_subprocesses_number(executor, 0)

    _CALLREG_CASE.append(_CallregCase)
    return _CallregCase


def callreg_name(cls: type) -> str:
    return CALLREG_PREFIX + cls.__name__


def callreg_class(cls: type) -> type:
    """The callreg subclass of the suite class ``cls``."""
    name = callreg_name(cls)
    namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": name, "_loky_suite_original": cls}
    return type(name, (callreg_case(), cls), namespace)


_CALLREG_CLASSES: dict[str, type] = {}


def callreg_classes() -> dict[str, type]:
    """Every callreg subclass, by name (made once)."""
    if not _CALLREG_CLASSES:
        for method in START_METHODS:
            for cls in suite_classes(method):
                _CALLREG_CLASSES[callreg_name(cls)] = callreg_class(cls)
    return _CALLREG_CLASSES


def __getattr__(name: str) -> Any:
    # The callreg subclasses, by name: what pickle finds in a target that
    # imports this module fresh (a fork server's target unpickling a bound
    # classmethod of a test).
    if name.startswith(CALLREG_PREFIX):
        cls = callreg_classes().get(name)
        if cls is not None:
            return cls
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def install_callreg() -> None:
    """Puts the callreg subclasses in the suite's modules under the suite
    classes' names (what pytest collects), and the redirections of the
    suite's helpers."""
    for method in START_METHODS:
        module = suite_module(method)
        for cls in suite_classes(method):
            setattr(module, cls.__name__, callreg_classes()[callreg_name(cls)])
    generic: Any = importlib.import_module(GENERIC_MODULE)
    generic.check_subprocess_call = _redirected(generic.check_subprocess_call)
    mixin: Any = importlib.import_module(MIXIN_MODULE)
    mixin._running_children_pids_with_cmdline = _test_processes_only(mixin._running_children_pids_with_cmdline)
    mixin._check_subprocesses_number = _counting_test_processes(mixin._check_subprocesses_number)


# -- the pytest plugin (one run) -------------------------------------------


class _Events:
    """The JSON lines a run writes: ``start`` and ``end`` per test,
    ``after`` when what follows a test begins, ``collect`` per collection
    error, ``done`` at its end."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115  # closed at exit
        self._lock = threading.Lock()

    def write(self, **event: Any) -> None:
        with self._lock:
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()


class _Plugin:
    """One run's state: its events, the per-test timeout, the tests to
    leave out and skip."""

    def __init__(self, config: Any) -> None:
        self.executor: str = config.getoption("loky_suite_executor")
        self.events = _Events(config.getoption("loky_suite_results"))
        self.timeout: float = config.getoption("loky_suite_test_timeout")
        self.full_control: bool = config.getoption("loky_suite_full_control")
        self.omit: set[str] = set()
        omit = config.getoption("loky_suite_omit")
        if omit:
            with open(omit, encoding="utf-8") as f:
                self.omit = set(json.load(f))
        # nodeid -> (outcome, detail) of the running test's phases so far.
        self.outcomes: dict[str, tuple[str, str]] = {}

    def arm(self) -> None:
        # Its own C thread, as regrtest's --timeout: no Python thread is
        # added to the process the tests fork.
        sys.stderr.flush()
        faulthandler.dump_traceback_later(self.timeout, exit=True)


_plugin: _Plugin | None = None


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("loky_suite", "loky's suite against callreg (python/tools/loky_suite.py)")
    group.addoption("--loky-suite-executor", choices=EXECUTORS, default=None, dest="loky_suite_executor")
    group.addoption("--loky-suite-results", default=None, dest="loky_suite_results")
    group.addoption("--loky-suite-omit", default=None, dest="loky_suite_omit")
    group.addoption("--loky-suite-test-timeout", type=float, default=120.0, dest="loky_suite_test_timeout")
    group.addoption("--loky-suite-full-control", action="store_true", dest="loky_suite_full_control")


def pytest_configure(config: Any) -> None:
    global _plugin
    if not config.getoption("loky_suite_results"):
        return
    _plugin = _Plugin(config)
    if _plugin.executor == "callreg":
        install_callreg()


def pytest_collectreport(report: Any) -> None:
    if _plugin is not None and report.failed:
        _plugin.events.write(event="collect", id=report.nodeid, detail=str(report.longrepr))


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    if _plugin is None:
        return
    pytest: Any = importlib.import_module("pytest")
    excluded: dict[str, dict[str, str]] = {}
    kept, dropped = [], []
    for item in items:
        key = key_of(item.nodeid)
        if key in _plugin.omit:
            dropped.append(item)
            continue
        kept.append(item)
        if _plugin.executor == "loky" and _plugin.full_control:
            continue
        cls = getattr(item, "cls", None)
        if cls is None:
            continue
        original = getattr(cls, "_loky_suite_original", cls)
        method = key.split(".")[0].rsplit("_", 1)[-1]
        if original.__name__ not in excluded:
            excluded[original.__name__] = exclusions(original, method)
        reason = excluded[original.__name__].get(item.originalname)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason="excluded for callreg: %s" % reason))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    if _plugin is None:
        return
    _plugin.outcomes[nodeid] = ("passed", "")
    _plugin.events.write(event="start", id=key_of(nodeid))
    _plugin.arm()


def pytest_runtest_logreport(report: Any) -> None:
    if _plugin is None:
        return
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    if report.failed:
        outcome, detail = "failed", "%s: %s" % (report.when, report.longreprtext)
    elif report.skipped:
        if hasattr(report, "wasxfail"):
            outcome, detail = "passed", ""  # an expected failure
        else:
            longrepr = report.longrepr
            outcome = "skipped"
            detail = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    else:
        return
    before = _plugin.outcomes.get(report.nodeid, ("passed", ""))
    if rank[outcome] > rank[before[0]]:
        _plugin.outcomes[report.nodeid] = (outcome, detail)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    if _plugin is None:
        return
    outcome, detail = _plugin.outcomes.pop(nodeid, ("passed", ""))
    key = key_of(nodeid)
    _plugin.events.write(event="end", id=key, outcome=outcome, detail=detail)
    # What runs next (class and module fixtures, their cleanups, the
    # interpreter's exit) is watched as well.
    _plugin.events.write(event="after", id=key)
    _plugin.arm()


def pytest_sessionfinish(session: Any, exitstatus: Any) -> None:
    if _plugin is None:
        return
    _plugin.events.write(event="done")
    # The interpreter's exit (the executors it waits for) stays watched.
    _plugin.arm()


# -- the command -----------------------------------------------------------


class Run:
    """One executor's outcomes for one start method."""

    def __init__(self, executor: str, start_method: str) -> None:
        self.executor = executor
        self.start_method = start_method
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.done = False
        self.returncode = 0
        self.seconds = 0.0
        # The tests a run ended in (each then run on by a new process).
        self.ended_in: list[str] = []
        # How runs ended outside any test.
        self.aborts: list[str] = []

    def read(self, path: str, returncode: int) -> bool:
        """Takes one process's events; ``True`` when it ran to its end. A
        test it started and never ended (it hung, or the process crashed
        in it) fails."""
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
                elif kind == "collect":
                    self.aborts.append("collecting %s failed:\n%s" % (event["id"], event["detail"]))
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
                    "a run ended (exit code %d) %s, in no test: a class or module fixture or cleanup hung "
                    "past --test-timeout or crashed (every thread's traceback is in the run's output)"
                    % (returncode, "after %s" % after if after else "before its first test")
                )
        return done

    def counts(self) -> str:
        tally = {"passed": 0, "failed": 0, "skipped": 0}
        for outcome, _ in self.outcomes.values():
            tally[outcome] += 1
        return "%s %s: %d passed, %d failed, %d skipped" % (
            self.executor,
            self.start_method,
            tally["passed"],
            tally["failed"],
            tally["skipped"],
        )


# How many times a run goes on, in a new process, after one ended in a test.
MAX_RESUMES = 5


def run_one(args: argparse.Namespace, root: str, executor: str, start_method: str) -> Run:
    """Runs one executor's tests for one start method in a pytest process;
    when it ends in a test (a hang, a crash), a new one runs the tests not
    run yet."""
    run = Run(executor, start_method)
    with contextlib.ExitStack() as stack:
        output: IO[str] | None = None
        log = ""
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)
            log = os.path.join(os.path.abspath(args.log_dir), "%s-%s.log" % (executor, start_method))
            output = stack.enter_context(open(log, "w", encoding="utf-8"))
        what = (
            " (callreg.Executor mp_context=%r)" % CALLREG_START_METHODS[start_method] if executor == "callreg" else ""
        )
        print("== %s %s%s%s" % (executor, start_method, what, " (log: %s)" % log if log else ""), flush=True)
        began = time.monotonic()
        for _ in range(MAX_RESUMES + 1):
            run.done, resumable = _run_once(args, root, run, output)
            if run.done or not resumable:
                break
        run.seconds = time.monotonic() - began
    return run


def _run_once(args: argparse.Namespace, root: str, run: Run, output: IO[str] | None) -> tuple[bool, bool]:
    """One pytest process of ``run``, leaving out the tests ``run`` has
    outcomes of: whether it ran to its end, and whether it ended in a test
    (a new process may go on after it)."""
    fd, path = tempfile.mkstemp(prefix="loky-suite-", suffix=".jsonl")
    os.close(fd)
    fd, omit_path = tempfile.mkstemp(prefix="loky-suite-omit-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(sorted(run.outcomes), f)
    command = [sys.executable, "-m", "pytest", "-p", __name__, "-p", "no:cacheprovider"]
    command += ["-v" if args.verbose else "-q", "-rfEs" if args.verbose else "-rfE"]
    # loky's per-test faulthandler timeout (its pytest settings) would
    # cancel this plugin's: --test-timeout replaces it.
    command += ["-o", "faulthandler_timeout=0", "--loky-verbosity", "30"]
    if not args.high_memory:
        command.append("--skip-high-memory")
    command += ["--loky-suite-executor", run.executor, "--loky-suite-results", path, "--loky-suite-omit", omit_path]
    command += ["--loky-suite-test-timeout", str(args.test_timeout)]
    if args.full_control:
        command.append("--loky-suite-full-control")
    if args.k is not None:
        command += ["-k", args.k]
    command.append("tests/test_process_executor_%s.py" % run.start_method)
    env = dict(os.environ, PYTHONPATH=_pythonpath(root))
    try:
        if output is not None:
            output.flush()
        # A session of its own: what it leaves behind when it ends in a
        # test is killed with it.
        child = subprocess.Popen(command, cwd=root, env=env, stdout=output, stderr=output, start_new_session=True)
        try:
            returncode = child.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            returncode = child.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        known = len(run.outcomes)
        done = run.read(path, returncode)
        return done, not done and len(run.outcomes) > known
    finally:
        os.unlink(path)
        os.unlink(omit_path)


def expected_reason(key: str) -> str | None:
    for pattern, reason in EXPECTED_DIFFERENCES.items():
        if fnmatch.fnmatchcase(key, pattern):
            return reason
    return None


def _summary(detail: str) -> str:
    """The error of a pytest report: its first ``E`` line (the detail's
    first line when it has none)."""
    lines = detail.strip().splitlines()
    errors = [line[1:].strip() for line in lines if line.startswith("E ") and line[1:].strip()]
    line = errors[0] if errors else (lines[0] if lines else "")
    return line if len(line) <= 240 else line[:237] + "..."


def report(runs: list[Run], executors: list[str]) -> int:
    """Prints the counts and callreg's failures; the exit status."""
    status = 0
    print()
    for run in runs:
        print(run.counts())
    print()
    for run in runs:
        note = " (a run ended in %s)" % ", ".join(run.ended_in) if run.ended_in else ""
        if not run.done:
            note += " (did not finish: exit code %d)" % run.returncode
        print("wall time %s %s: %.1f s%s" % (run.executor, run.start_method, run.seconds, note))
        for abort in run.aborts:
            print("    %s" % abort)
        if not run.done or run.aborts:
            status = 1
    print("wall time in all: %.1f s" % sum(run.seconds for run in runs))
    by_method = {(run.executor, run.start_method): run for run in runs}
    for run in runs:
        if run.executor != "callreg":
            continue
        control = by_method.get(("loky", run.start_method))
        failed = sorted(key for key, (outcome, _) in run.outcomes.items() if outcome == "failed")
        if failed:
            print("\ncallreg %s failures:" % run.start_method)
        for key in failed:
            loky = control.outcomes.get(key, ("not run", ""))[0] if control is not None else "not run"
            reason = expected_reason(key)
            if loky == "passed" or control is None:
                mark = "EXPECTED" if reason else "NEW"
                if reason is None:
                    status = 1
            else:
                mark = "loky %s" % loky
            print("  [%s] %s (loky: %s)\n      %s" % (mark, key, loky, _summary(run.outcomes[key][1])))
        passing = sorted(
            key for key, (outcome, _) in run.outcomes.items() if outcome == "passed" and expected_reason(key)
        )
        for key in passing:
            print("  (expected to differ, passed for callreg: %s)" % key)
    if "loky" not in executors and any(run.executor == "callreg" for run in runs):
        print("\n(no loky control run: every callreg failure not in EXPECTED_DIFFERENCES counts)")
    return status


def list_expected(root: str, start_methods: list[str]) -> None:
    sys.path.insert(0, root)
    print("EXPECTED_DIFFERENCES (callreg failures accepted where loky passes):")
    for pattern, reason in EXPECTED_DIFFERENCES.items():
        print("  %s\n      %s" % (pattern, reason))
    print("\nExcluded for callreg (skipped, with the reason):")
    for method in start_methods:
        for cls in suite_classes(method):
            for name, reason in exclusions(cls, method).items():
                print("  test_process_executor_%s.%s.%s\n      %s" % (method, cls.__name__, name, reason))


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--sdist", help="loky %s's unpacked sdist (or its .tar.gz)" % LOKY_VERSION)
    source.add_argument("--cache", help="a directory to download and unpack loky %s's sdist into" % LOKY_VERSION)
    parser.add_argument("--executor", choices=(*EXECUTORS, "both"), default="both")
    parser.add_argument("--start-method", choices=START_METHODS, action="append", dest="start_method")
    parser.add_argument("-k", help="pytest's -k expression: run only the tests it selects")
    parser.add_argument("--list-expected", action="store_true", help="print the expected differences and exclusions")
    parser.add_argument("--test-timeout", type=float, default=120.0, help="seconds one test may run (default 120)")
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one run may take (default 1800)")
    parser.add_argument(
        "--full-control", action="store_true", help="run the tests excluded for callreg for loky too (the whole suite)"
    )
    parser.add_argument(
        "--high-memory", action="store_true", help="run loky's high-memory test too (it sends 2.2 GB to a worker)"
    )
    parser.add_argument("--log-dir", help="write each run's output to <dir>/<executor>-<start method>.log")
    parser.add_argument("--verbose", "-v", action="store_true", help="name each test as it runs")
    args = parser.parse_args(argv)
    args.start_method = args.start_method or list(START_METHODS)
    args.executor = list(EXECUTORS) if args.executor == "both" else [args.executor]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    root = sdist_root(args)
    if args.list_expected:
        list_expected(root, args.start_method)
        return 0
    runs = [run_one(args, root, executor, method) for method in args.start_method for executor in args.executor]
    return report(runs, args.executor)


if __name__ == "__main__":
    # Run as this module (not __main__): the pytest processes load it as
    # their plugin by this name.
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    sys.exit(importlib.import_module("loky_suite").main())
