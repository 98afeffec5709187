"""callreg.Executor: a :class:`concurrent.futures.Executor` over a
:class:`callreg.Worker` (``specs/python.md`` §3a)."""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import os
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from callreg import _callreg
from callreg._callables import callable_name, check_registrable, default_metadata
from callreg._codes import CODES
from callreg._envelope import InheritingPickler, main_objects, pack_with, task_input
from callreg._errors import CallregError, RegisterError, TargetLostError
from callreg._futures import TaskFuture
from callreg._handle import Handle
from callreg._options import WORKER_OPTIONS
from callreg._worker import Worker, _failed_with

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from callreg._options import WorkerOptions

_P = ParamSpec("_P")
_T = TypeVar("_T")


class TaskOptions(Generic[_P, _T]):
    """A callable with task options, for :class:`Executor` (made by
    :func:`options`): calling it calls the callable."""

    __slots__ = ("fn", "timeout")

    def __init__(self, fn: Callable[_P, _T], timeout: float | None) -> None:
        self.fn = fn
        self.timeout = timeout

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return "callreg.options(%r, timeout=%r)" % (self.fn, self.timeout)


def options(fn: Callable[_P, _T], /, *, timeout: float | None = None) -> TaskOptions[_P, _T]:
    """``fn`` with task options, for :meth:`Executor.submit` and
    :meth:`Executor.map` (whose keyword arguments are all ``fn``'s, as
    ``ProcessPoolExecutor``'s are)::

        ex.submit(callreg.options(slow, timeout=2.0), x)

    ``timeout`` (seconds, ``None``: none) is how long each task may run,
    counted from its start in its target (never from the submit): past it
    the task fails with :class:`TaskTimeoutError` and its target is killed
    and replaced; tasks queued there that never started run elsewhere
    (``specs/protocol.md`` §2.12, §2.15). Raises ``ValueError`` at
    submit for a ``timeout`` that is not a positive number of seconds."""
    return TaskOptions(fn, timeout)


# Start methods of multiprocessing, as an Executor's mp_context names
# them, to callreg's (specs/python.md §3a, "The peers' constructor").
_START_METHODS = {"fork": "fork", "forkserver": "forkserver", "spawn": "forkserver"}


def _start_method_of(mp_context: object) -> str:
    """callreg's start method for ``mp_context`` (a ``multiprocessing``
    context or a start method's name). Raises ``TypeError`` or
    ``ValueError`` naming the accepted values."""
    if isinstance(mp_context, str):
        name = mp_context
    else:
        get = getattr(mp_context, "get_start_method", None)
        if get is None:
            raise TypeError(
                "Executor's mp_context must be a multiprocessing context or a start method's name "
                "('fork', 'forkserver', 'spawn'), not %s" % type(mp_context).__name__
            )
        name = get(allow_none=False) if _takes_allow_none(get) else get()
    try:
        return _START_METHODS[name]
    except KeyError:
        raise ValueError(
            "Executor's mp_context %r has no callreg equivalent: use 'fork', 'forkserver' or 'spawn' "
            "(spawn starts targets from a fresh interpreter, as forkserver does)" % (name,)
        ) from None


def _takes_allow_none(get: Callable[..., Any]) -> bool:
    # BaseContext.get_start_method(allow_none=False); a context of a
    # fixed method (ForkContext, ...) has it too.
    try:
        get(allow_none=False)
    except TypeError:
        return False
    return True


def _identity(fn: object) -> tuple[object, tuple[Any, ...]] | None:
    """The key of ``fn`` in an Executor's cache of callables seen, by
    identity, and what checks that the object under the key is still
    ``fn`` (:func:`_is_same`): weak references where the object allows
    them (a bound method, made anew at each attribute access: keyed by
    its object and function, both held weakly, so that the cache keeps
    neither alive), ``fn`` itself for a builtin function of a module (it
    lives as long as its module). ``None`` for other objects: those are
    looked up by hashid only."""
    if isinstance(fn, types.MethodType):
        try:
            return (id(fn.__self__), id(fn.__func__)), (weakref.ref(fn.__self__), weakref.ref(fn.__func__))
        except TypeError:
            return None
    try:
        return id(fn), (weakref.ref(fn),)
    except TypeError:
        pass
    if isinstance(fn, types.BuiltinFunctionType) and isinstance(fn.__self__, (types.ModuleType, type(None))):
        return id(fn), (lambda: fn,)
    return None


def _is_same(fn: object, keep: tuple[Any, ...]) -> bool:
    """Whether ``keep`` (from :func:`_identity`) still names ``fn``."""
    if len(keep) == 2:
        return isinstance(fn, types.MethodType) and keep[0]() is fn.__self__ and keep[1]() is fn.__func__
    return keep[0]() is fn


class _State:
    """What an Executor owns, apart from the Executor object: what its
    finalizer needs to finish its work once nothing holds the Executor."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.lock = threading.Lock()
        # hashid -> Handle, least recently used first.
        self.handles: collections.OrderedDict[str, Handle[..., Any]] = collections.OrderedDict()
        # The futures of tasks submitted and not resolved: held strongly,
        # so that work nobody keeps a future of still runs to its end.
        # Each takes itself out once resolved (TaskFuture._release).
        self.futures: set[concurrent.futures.Future[Any]] = set()
        # len(futures) at which the next submit looks whether the results
        # of those nobody waits on arrived.
        self.sweep_at = _SWEEP_MIN
        self.shutdown = False
        self.finished = threading.Event()

    def track(self, future: concurrent.futures.Future[Any]) -> None:
        """Holds ``future`` until it is resolved. Called with ``lock``
        held."""
        futures = self.futures
        if not isinstance(future, TaskFuture):
            return  # failed at submit: nothing runs
        future._held_by = futures
        futures.add(future)
        if len(futures) >= self.sweep_at:
            # done() resolves those whose results are here: each takes
            # itself out.
            for held in list(futures):
                held.done()
            self.sweep_at = max(_SWEEP_MIN, 2 * len(futures))

    def finish(self) -> None:
        """Waits for every task submitted, then unregisters every callable
        and closes the Worker."""
        try:
            with self.lock:
                futures = list(self.futures)
            # Each waited for inline, which starts no thread (at
            # interpreter exit, Python 3.12 and later start none).
            for future in futures:
                if not future.cancelled():
                    try:
                        future.exception()
                    except concurrent.futures.CancelledError:
                        pass
            with self.lock:
                handles = list(self.handles.values())
                self.handles.clear()
                self.futures.clear()
            for handle in handles:
                try:
                    self.worker.unregister(handle)
                except CallregError:
                    pass  # the Worker closes next: nothing is left anyway
        finally:
            self.worker.close()
            self.finished.set()


# The smallest number of futures held before a submit looks whether the
# results of those nobody waits on arrived (each look may read the
# targets' replies: a system call). Above what a program keeps in flight
# at once, so that such a program never pays for it; a program that
# submits without ever waiting holds at most twice as many futures as
# its tasks not yet ended, plus this many.
_SWEEP_MIN = 8192


def _finish_abandoned(state: _State) -> None:
    """An Executor's finalizer (nothing holds it any more, its ``shutdown``
    never ran): its tasks run to their end, as an abandoned
    ``ProcessPoolExecutor``'s do, in a thread that interpreter exit joins;
    then its Worker closes."""
    with state.lock:
        if state.shutdown:
            return
        state.shutdown = True
    try:
        threading.Thread(target=state.finish, name="callreg-shutdown").start()
    except RuntimeError:  # at interpreter exit: no new thread
        state.finish()


class Executor(concurrent.futures.Executor):
    """A :class:`concurrent.futures.Executor` over a :class:`Worker`: what a
    ``ProcessPoolExecutor`` or loky program switches to by changing its
    constructor::

        with callreg.Executor(4) as ex:           # was ProcessPoolExecutor(4)
            print(ex.submit(pow, 2, 10).result())  # 1024
            print(list(ex.map(abs, [-1, -2], chunksize=100)))  # [1, 2]

    ``max_workers`` targets (``None``: one per CPU) are forked when it is
    built (from the building thread: build it where it lives, usually the
    main thread). ``initializer(*initargs)`` runs in every target and
    replacement before it serves. ``mp_context`` is
    ``ProcessPoolExecutor``'s: a ``multiprocessing`` context or a start
    method's name; ``"fork"`` (the default) forks the targets from this
    process, ``"forkserver"`` and ``"spawn"`` from a fresh interpreter
    (``start_method="forkserver"``: callreg has no spawn; both give
    targets that inherit nothing of this process's state).
    ``worker_options`` are the :class:`Worker`'s (``control_timeout``,
    ``slot_capacity``, ``max_frame_bytes``, ``start_method``,
    ``preload``, ...; not ``next_level``).

    Each callable is pickled and registered once, at its first use, and
    its handle reused for every later task (looked up by the callable's
    identity, never by ``==``, then by hashid: a lambda built anew each
    time is pickled each time but registered once; two callables that
    compare equal but pickle differently each run as themselves); the
    callable's bytes then never travel again, only each task's
    arguments. So a callable's captured state is what it was at its
    first use: a change made later in this process is not seen by the
    targets (build a new callable). The lookup holds the callable (a
    bound method: its object) only weakly. Functions and classes defined
    at the top level of ``__main__`` before the Executor was built are
    pickled by name, as ``ProcessPoolExecutor`` pickles them: every
    target, forked then, has them, and they see the target's own module
    globals (what ``initializer`` set there); not under
    ``"forkserver"``, whose targets have a ``__main__`` of their own:
    everything is pickled by value there. Others (lambdas, closures,
    functions defined later) are pickled by value, with a copy of the
    globals they use. At most ``slot_capacity`` callables stay
    registered; the least recently used is unregistered to make room
    (its queued tasks run first; when a target's slots are still held by
    such tasks, the next is unregistered too, or the register waits for
    them, at most ``control_timeout``), and every one at
    :meth:`shutdown`.

    No work is lost: every task submitted runs to its end before
    :meth:`shutdown` (``wait=True``), the end of a ``with`` block or the
    interpreter's exit returns, whether or not its future is kept, as
    with ``ProcessPoolExecutor``; an Executor nothing holds any more
    finishes its tasks in a thread, then closes.

    Futures are running from :meth:`submit` (the task is sent at once, or,
    with ``max_tasks_per_child``, waits for a target that takes it);
    :meth:`concurrent.futures.Future.cancel` still stops a task that has
    not started in its target (it waits there behind others) and returns
    ``True``, as do ``shutdown(cancel_futures=True)`` and a ``map``
    iterator left early. A task's exception is raised by ``result()`` as
    itself (:meth:`Worker.submit`). A deadline per task: :func:`options`.

    ``max_tasks_per_child`` (as ``ProcessPoolExecutor``'s; the Worker's
    ``max_tasks_per_target``): a target process that ran this many tasks
    is replaced by a fresh one, forked from the template made at start
    (so, unlike ``ProcessPoolExecutor``'s, it works with the ``"fork"``
    start method too); tasks no target can take meanwhile wait and go to
    the replacement (``specs/protocol.md`` §2.14).

    Raises ``ValueError`` when ``max_workers`` or ``max_tasks_per_child``
    is not positive, ``mp_context`` names another start method, or
    ``max_tasks_per_child`` is given with ``respawn_limit=0`` or beside a
    different ``max_tasks_per_target``; ``TypeError`` for an unknown keyword
    (``next_level``: a Worker's option only), a ``max_tasks_per_child``
    that is not an integer, a non-callable ``initializer`` or an
    ``mp_context`` that is neither; and what :meth:`Worker.start` raises."""

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: object = None,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[Any] = (),
        *,
        max_tasks_per_child: int | None = None,
        **worker_options: Unpack[WorkerOptions],
    ) -> None:
        unknown = sorted(set(worker_options) - WORKER_OPTIONS)
        if unknown:
            hint = {
                "next_level": "use a Worker for trees of Workers",
                "next_level_targets": "use a Worker for trees of Workers",
            }
            raise TypeError(
                "Executor got an unexpected keyword argument %r%s; its options are max_workers, mp_context, "
                "initializer, initargs, max_tasks_per_child and the Worker's: %s"
                % (
                    unknown[0],
                    " (%s)" % hint[unknown[0]] if unknown[0] in hint else "",
                    ", ".join(sorted(WORKER_OPTIONS)),
                )
            )
        # As ProcessPoolExecutor's; the Worker checks the rest.
        if max_workers is not None and max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if max_tasks_per_child is not None:
            if not isinstance(max_tasks_per_child, int):
                raise TypeError("max_tasks_per_child must be an integer")
            if max_tasks_per_child <= 0:
                raise ValueError("max_tasks_per_child must be >= 1")
            if worker_options.setdefault("max_tasks_per_target", max_tasks_per_child) != max_tasks_per_child:
                raise ValueError(
                    "Executor's max_tasks_per_child (%d) and max_tasks_per_target=%r disagree: give one of them"
                    % (max_tasks_per_child, worker_options["max_tasks_per_target"])
                )
        if mp_context is not None:
            method = _start_method_of(mp_context)
            if worker_options.setdefault("start_method", method) != method:  # type: ignore[typeddict-item]
                raise ValueError(
                    "Executor's mp_context (%s) and start_method=%r disagree: give one of them"
                    % (method, worker_options["start_method"])
                )
        worker = Worker(max_workers, initializer=initializer, initargs=initargs, **worker_options)
        self._state = state = _State(worker)
        # callable identity (_identity) -> (what checks it, hashid), least
        # recently used first.
        self._seen: collections.OrderedDict[object, tuple[tuple[Any, ...], str]] = collections.OrderedDict()
        _wait_at_exit_for(self)
        # Every target's __main__ holds these (forked next): pickled by
        # name. A forkserver target's __main__ is not this one's: nothing.
        inherited = main_objects() if worker._start_method == "fork" else {}
        self._pickler = type("_Pickler", (InheritingPickler,), {"inherited": inherited})
        try:
            # A warning about threads under fork names the caller's line.
            worker._start(2)
        except BaseException:
            state.shutdown = True
            worker.close()
            raise
        self._finalizer = weakref.finalize(self, _finish_abandoned, state)
        # Interpreter exit shuts down the Executors alive first
        # (_wait_at_exit): the finalizer is for those collected before.
        self._finalizer.atexit = False

    def __repr__(self) -> str:
        return "<callreg.Executor over %r>" % (self._state.worker,)

    @property
    def worker(self) -> Worker:
        """The :class:`Worker` under this Executor (its targets, events,
        ``call_all``)."""
        return self._state.worker

    def _raw_for(self, fn: Callable[..., Any]) -> _callreg.RawHandle:
        """The raw handle of ``fn``, registered at its first use. Called
        with the lock held."""
        state = self._state
        # The usual case first: a function, class or other object seen
        # before, under its own id (a bound method, made anew at each
        # access, is under its object's and function's: below).
        seen = self._seen.get(id(fn))
        if seen is not None and len(seen[0]) == 1 and seen[0][0]() is fn:
            handle = state.handles.get(seen[1])
            if handle is not None:
                state.handles.move_to_end(seen[1])
                self._seen.move_to_end(id(fn))
                return handle._raw
        identity = _identity(fn)
        if identity is not None:
            key, keep = identity
            seen = self._seen.get(key)
            if seen is not None and _is_same(fn, seen[0]):
                handle = state.handles.get(seen[1])
                if handle is not None:
                    state.handles.move_to_end(seen[1])
                    self._seen.move_to_end(key)
                    return handle._raw
        check_registrable(fn, "submit")
        try:
            envelope = pack_with(fn, self._pickler)
        except Exception as error:
            raise _Unpicklable(error) from error
        hashid = _callreg.envelope_hashid(envelope)
        handle = state.handles.get(hashid)
        if handle is None:
            while len(state.handles) >= state.worker._slot_capacity:
                self._evict()
            handle = self._register_making_room(envelope, default_metadata(callable_name(fn)))
            CODES.record(fn)
            state.handles[hashid] = handle
        else:
            state.handles.move_to_end(hashid)
        if identity is not None:
            self._seen[identity[0]] = (identity[1], hashid)
            self._seen.move_to_end(identity[0])
            while len(self._seen) > 4 * state.worker._slot_capacity:
                self._seen.popitem(last=False)
        return handle._raw

    def _evict(self) -> None:
        """Unregisters the least recently used callable. Called with the
        lock held."""
        old, evicted = self._state.handles.popitem(last=False)
        for key in [key for key, (_, value) in self._seen.items() if value == old]:
            del self._seen[key]
        try:
            self._state.worker.unregister(evicted)
        except TargetLostError:
            pass  # released all the same: a lost target holds nothing

    def _register_making_room(self, envelope: bytes, meta: dict[str, Any]) -> Handle[..., Any]:
        """Registers ``envelope``; while a target has no free slot for it,
        unregisters the least recently used callable first, or, with none
        left to unregister, waits for the slots of unregistered callables
        whose tasks still run (tombstones) to free, for at most the
        control timeout; with every target lost and being replaced, waits
        for a replacement to serve, as long. Called with the lock held."""
        worker = self._state.worker
        deadline = time.monotonic() + worker._control_timeout
        delay = 0.001
        while True:
            try:
                return worker._register(envelope, meta)
            except TargetLostError as error:
                # Every target lost, their replacements on the way (an
                # evicted callable's finalizer may have ended them all):
                # wait for one to serve, for at most the control timeout.
                # One may have joined since the refusal: then try again
                # at once. Only when every target is lost for good
                # (``"lost"``: given up) is the refusal final.
                coming = any(worker.target_phase(t) != "lost" for t in range(worker._count))
                if error.code != "NO_LIVE_TARGET" or not coming or time.monotonic() >= deadline:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, 0.05)
                continue
            except RegisterError as error:
                if not error.refused_for("LOCAL_SLOT_EXHAUSTED") or (
                    not self._state.handles and time.monotonic() >= deadline
                ):
                    raise
            if self._state.handles:
                self._evict()
            else:
                time.sleep(delay)
                delay = min(2 * delay, 0.05)

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> concurrent.futures.Future[_T]:
        """Runs ``fn(*args, **kwargs)`` in a target and returns its
        :class:`concurrent.futures.Future` (every keyword argument is
        ``fn``'s, ``target`` and ``timeout`` included; ``fn`` may be
        :func:`options` of a callable, for a deadline). Raises
        ``RuntimeError`` after :meth:`shutdown`, ``TypeError`` for a
        non-callable or async ``fn``, and :class:`RegisterError` when a
        target could not install it. An argument or callable that cannot
        be pickled fails the future with what pickling raised, as
        ``ProcessPoolExecutor``'s does (``result()`` raises it)."""
        timeout = None
        if isinstance(fn, TaskOptions):
            timeout = fn.timeout
            fn = fn.fn
        state = self._state
        data: bytes | Exception
        try:
            data = task_input(args, kwargs)
        except Exception as error:  # an argument cannot be pickled
            data = error
        with state.lock:
            if state.shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if isinstance(data, Exception):
                return _failed_with(data)
            try:
                raw = self._raw_for(fn)
            except _Unpicklable as unpicklable:
                return _failed_with(unpicklable.error)
            future = state.worker._submit(raw, None, data, timeout)
            state.track(future)
        return future

    def map(
        self, fn: Callable[..., _T], *iterables: Iterable[Any], timeout: float | None = None, chunksize: int = 1
    ) -> Iterator[_T]:
        """``fn`` applied to the items of ``iterables`` (as
        :func:`map`), in targets: an iterator of the results in order,
        raising what a call raised when it reaches it. Every call is
        submitted at once; ``chunksize`` calls go in one task (one frame
        each way; a call that raises fails its chunk, as
        ``ProcessPoolExecutor``'s do). ``timeout`` (seconds from this
        call) raises :class:`concurrent.futures.TimeoutError` for a result
        not there in time; the calls not started when the iterator stops
        early (a result raised, it was closed, Ctrl-C) are cancelled. An
        iterator never read, or dropped unread, cancels nothing: every
        call runs. Each result is released once yielded. ``fn`` may be
        :func:`options` of a callable: each task (each chunk) then has
        its deadline."""
        task_timeout = None
        if isinstance(fn, TaskOptions):
            task_timeout = fn.timeout
            fn = fn.fn
        state = self._state
        with state.lock:
            if state.shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            try:
                raw = self._raw_for(fn)
            except _Unpicklable as unpicklable:
                return _raising(unpicklable.error)
            return state.worker._map(raw, iterables, timeout, chunksize, task_timeout, state.track)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False, kill_workers: bool = False) -> None:
        """No new task after this. ``wait=True``: waits for every task
        submitted, then unregisters every callable and closes the Worker
        (its targets are reaped). ``wait=False``: returns at once; the same
        happens in a background thread once the tasks finished (and
        interpreter exit waits for them, as for an Executor never shut
        down: as ``ProcessPoolExecutor``'s, its tasks run to their end).
        ``cancel_futures=True``: first cancels every task that has not
        started in its target (those never run; their futures are
        cancelled). ``kill_workers=True`` (loky's): cancels those too, then
        closes the Worker at once, killing the targets: a task running
        there fails with :class:`LifecycleError`. Idempotent."""
        state = self._state
        with state.lock:
            first = not state.shutdown
            state.shutdown = True
            futures = list(state.futures)
        self._finalizer.detach()
        if cancel_futures or kill_workers:
            # The last submitted first: they are the least likely to
            # have started.
            for future in reversed(futures):
                if not future.done():
                    future.cancel()
        if kill_workers:
            state.worker.close()
        if not first:
            if wait:
                state.finished.wait()
            return
        if wait:
            state.finish()
        else:
            threading.Thread(target=state.finish, name="callreg-shutdown", daemon=True).start()

    def terminate_workers(self) -> None:
        """Python 3.14's ``ProcessPoolExecutor.terminate_workers``: cancels
        every task not started, closes the Worker (its targets are stopped
        at once, a running task fails with :class:`LifecycleError`) and
        shuts down. Idempotent."""
        self.shutdown(wait=True, kill_workers=True)

    def kill_workers(self) -> None:
        """Python 3.14's ``ProcessPoolExecutor.kill_workers``: the same
        as :meth:`terminate_workers` (a Worker's close kills its
        targets)."""
        self.shutdown(wait=True, kill_workers=True)


class _Unpicklable(Exception):
    """A callable that cannot be pickled: ``error`` is what pickling it
    raised (the futures of its tasks fail with it)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def _raising(error: BaseException) -> Iterator[Any]:
    """An iterator that raises ``error`` when first read (``map`` of a
    callable that cannot be pickled: each of its results would be that
    error)."""
    raise error
    yield


# The Executors alive, each waited for at interpreter exit.
_LIVE: weakref.WeakSet[Executor] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # An inherited Executor's lock may have been held by a thread of the
    # parent at the fork (a submit registering a callable): a new one, so
    # that its submit, map and shutdown raise or return in the child
    # instead of waiting for a thread that does not exist there.
    for executor in list(_LIVE):
        executor._state.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _wait_at_exit_for(executor: Executor) -> None:
    """Has interpreter exit wait for ``executor``'s tasks, as it waits for
    a ``ProcessPoolExecutor``'s: one not shut down, or shut down without
    waiting, runs every task submitted to its end (a task cancelled does
    not run), then closes. The hook moves to the end of the ``atexit``
    list, so it runs before the hook that closes every Worker left open
    (``weakref.finalize``'s, registered at the first Worker made)."""
    _LIVE.add(executor)
    atexit.unregister(_wait_at_exit)
    atexit.register(_wait_at_exit)


def _wait_at_exit() -> None:
    # In a forked child, an inherited Executor's futures resolve at once
    # (LIFECYCLE_INVALID: the Worker is its parent's) and its close does
    # nothing: the child waits for nothing.
    for executor in list(_LIVE):
        if getattr(executor, "_finalizer", None) is not None:
            executor.shutdown(wait=True)
