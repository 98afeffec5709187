"""callreg.Executor: a :class:`concurrent.futures.Executor` over a
:class:`callreg.Worker` (``specs/python.md`` §3a)."""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import os
import threading
import time
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
from callreg._worker import Worker

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

    ``timeout`` (seconds, ``None``: none) is each task's deadline: past it
    the task fails with :class:`TaskTimeoutError` and its target is killed
    and replaced (``specs/protocol.md`` §2.12). Raises ``ValueError`` at
    submit for a ``timeout`` that is not a positive number of seconds."""
    return TaskOptions(fn, timeout)


class Executor(concurrent.futures.Executor):
    """A :class:`concurrent.futures.Executor` over a :class:`Worker`: what a
    ``ProcessPoolExecutor(mp_context=fork)`` or loky program switches to by
    changing its constructor::

        with callreg.Executor(4) as ex:           # was ProcessPoolExecutor(4)
            print(ex.submit(pow, 2, 10).result())  # 1024
            print(list(ex.map(abs, [-1, -2], chunksize=100)))  # [1, 2]

    ``max_workers`` targets (``None``: one per CPU) are forked when it is
    built (from the building thread: build it where it lives, usually the
    main thread). ``initializer(*initargs)`` runs in every target and
    replacement before it serves. ``worker_options`` are the
    :class:`Worker`'s (``control_timeout``, ``slot_capacity``,
    ``max_frame_bytes``, ``start_method``, ``preload``, ...; not
    ``next_level``). ``start_method="forkserver"`` is what
    ``ProcessPoolExecutor(mp_context=multiprocessing.get_context("forkserver"))``
    gives: the targets are forked by a fresh interpreter, not this one
    (:class:`Worker`).

    Each callable is pickled and registered once, at its first use, and
    its handle reused for every later task (looked up by the callable
    itself, then by hashid: a lambda built anew each time is pickled each
    time but registered once); the callable's bytes then never travel
    again, only each task's arguments. So a callable's captured state is
    what it was at its first use: a change made later in this process is
    not seen by the targets (build a new callable). Functions and classes
    defined at the top level of ``__main__`` before the Executor was built
    are pickled by name, as ``ProcessPoolExecutor`` pickles them: every
    target, forked then, has them, and they see the target's own module
    globals (what ``initializer`` set there); not under
    ``start_method="forkserver"``, whose targets have a ``__main__`` of
    their own: everything is pickled by value there. Others (lambdas, closures,
    functions defined later) are pickled by value, with a copy of the
    globals they use. At most
    ``slot_capacity`` callables stay registered; the least recently used
    is unregistered to make room (its queued tasks run first; when a
    target's slots are still held by such tasks, the next is unregistered
    too, or the register waits for them, at most ``control_timeout``), and
    every one at :meth:`shutdown`.

    Futures are running from :meth:`submit` (the task is sent at once);
    :meth:`concurrent.futures.Future.cancel` still stops a task that has
    not started in its target (it waits there behind others) and returns
    ``True``, as do ``shutdown(cancel_futures=True)`` and a ``map``
    iterator left early. A task's exception is raised by ``result()`` as
    :meth:`Worker.submit`'s are. A deadline per task: :func:`options`.

    Raises ``ValueError`` when ``max_workers`` is not positive,
    ``TypeError`` for ``next_level`` or a non-callable ``initializer``,
    and what :meth:`Worker.start` raises."""

    def __init__(
        self,
        max_workers: int | None = None,
        *,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[Any] = (),
        **worker_options: Unpack[WorkerOptions],
    ) -> None:
        if "next_level" in worker_options or "next_level_targets" in worker_options:
            raise TypeError("Executor takes no next_level: use a Worker for trees of Workers")
        # As ProcessPoolExecutor's; the Worker checks the rest.
        if max_workers is not None and max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        self._worker = Worker(max_workers, initializer=initializer, initargs=initargs, **worker_options)
        self._lock = threading.Lock()
        # hashid -> Handle, least recently used first.
        self._handles: collections.OrderedDict[str, Handle[..., Any]] = collections.OrderedDict()
        # callable -> hashid (callables seen before), least recently used first.
        self._seen: collections.OrderedDict[object, str] = collections.OrderedDict()
        self._futures: weakref.WeakSet[concurrent.futures.Future[Any]] = weakref.WeakSet()
        self._shutdown = False
        self._finished = threading.Event()
        _wait_at_exit_for(self)
        # Every target's __main__ holds these (forked next): pickled by
        # name. A forkserver target's __main__ is not this one's: nothing.
        inherited = main_objects() if self._worker._start_method == "fork" else {}
        self._pickler = type("_Pickler", (InheritingPickler,), {"inherited": inherited})
        try:
            # A warning about threads under fork names the caller's line.
            self._worker._start(2)
        except BaseException:
            self._worker.close()
            raise

    def __repr__(self) -> str:
        return "<callreg.Executor over %r>" % (self._worker,)

    @property
    def worker(self) -> Worker:
        """The :class:`Worker` under this Executor (its targets, events,
        ``call_all``)."""
        return self._worker

    def _raw_for(self, fn: Callable[..., Any]) -> _callreg.RawHandle:
        """The raw handle of ``fn``, registered at its first use. Called
        with ``self._lock`` held."""
        try:
            hashid = self._seen.get(fn)
        except TypeError:  # an unhashable callable: looked up by hashid
            hashid = None
        if hashid is not None:
            handle = self._handles.get(hashid)
            if handle is not None:
                self._handles.move_to_end(hashid)
                self._seen.move_to_end(fn)
                return handle._raw
        check_registrable(fn, "submit")
        envelope = pack_with(fn, self._pickler)
        hashid = _callreg.envelope_hashid(envelope)
        handle = self._handles.get(hashid)
        if handle is None:
            while len(self._handles) >= self._worker._slot_capacity:
                self._evict()
            handle = self._register_making_room(envelope, default_metadata(callable_name(fn)))
            CODES.record(fn)
            self._handles[hashid] = handle
        else:
            self._handles.move_to_end(hashid)
        try:
            self._seen[fn] = hashid
        except TypeError:
            pass
        else:
            while len(self._seen) > 4 * self._worker._slot_capacity:
                self._seen.popitem(last=False)
        return handle._raw

    def _evict(self) -> None:
        """Unregisters the least recently used callable. Called with
        ``self._lock`` held."""
        old, evicted = self._handles.popitem(last=False)
        for key in [key for key, value in self._seen.items() if value == old]:
            del self._seen[key]
        try:
            self._worker.unregister(evicted)
        except TargetLostError:
            pass  # released all the same: a lost target holds nothing

    def _register_making_room(self, envelope: bytes, meta: dict[str, Any]) -> Handle[..., Any]:
        """Registers ``envelope``; while a target has no free slot for it,
        unregisters the least recently used callable first, or, with none
        left to unregister, waits for the slots of unregistered callables
        whose tasks still run (tombstones) to free, for at most the
        control timeout; with every target lost and being replaced, waits
        for a replacement to serve, as long. Called with ``self._lock``
        held."""
        deadline = time.monotonic() + self._worker._control_timeout
        delay = 0.001
        while True:
            try:
                return self._worker._register(envelope, meta)
            except TargetLostError as error:
                # Every target lost, their replacements on the way (an
                # evicted callable's finalizer may have ended them all):
                # wait for one to serve, for at most the control timeout.
                # One may have joined since the refusal: then try again
                # at once. Only when every target is lost for good
                # (``"lost"``: given up) is the refusal final.
                coming = any(self._worker.target_phase(t) != "lost" for t in range(self._worker._count))
                if error.code != "NO_LIVE_TARGET" or not coming or time.monotonic() >= deadline:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, 0.05)
                continue
            except RegisterError as error:
                full = error.code == "LOCAL_SLOT_EXHAUSTED" or any(
                    "LOCAL_SLOT_EXHAUSTED" in outcome for outcome in error.outcomes.values()
                )
                if not full or (not self._handles and time.monotonic() >= deadline):
                    raise
            if self._handles:
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
        non-callable or async ``fn``, what cloudpickle raises for a
        callable it cannot pickle, and :class:`RegisterError` when a
        target could not install it."""
        timeout = None
        if isinstance(fn, TaskOptions):
            timeout = fn.timeout
            fn = fn.fn
        data = task_input(args, kwargs)
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future = self._worker._submit(self._raw_for(fn), None, data, timeout)
            self._track(future)
        return future

    def _track(self, future: concurrent.futures.Future[Any]) -> None:
        """Counts ``future`` among this Executor's tasks (a shutdown waits
        for it), and has it keep this Executor alive until it is resolved.
        Called with ``self._lock`` held."""
        self._futures.add(future)
        if isinstance(future, TaskFuture):
            future._owner = self

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
        early (a result raised, it was closed, Ctrl-C) are cancelled.
        ``fn`` may be :func:`options` of a callable: each task (each
        chunk) then has its deadline."""
        task_timeout = None
        if isinstance(fn, TaskOptions):
            task_timeout = fn.timeout
            fn = fn.fn
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            raw = self._raw_for(fn)
            return self._worker._map(raw, iterables, timeout, chunksize, task_timeout, self._track)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new task after this. ``wait=True``: waits for every task
        submitted, then unregisters every callable and closes the Worker
        (its targets are reaped). ``wait=False``: returns at once; the same
        happens in a background thread once the tasks finished (and
        interpreter exit waits for them, as for an Executor never shut
        down: as ``ProcessPoolExecutor``'s, its tasks run to their end).
        ``cancel_futures=True``: first cancels every task that has not
        started in its target (those never run; their futures are
        cancelled). Idempotent."""
        with self._lock:
            first = not self._shutdown
            self._shutdown = True
            futures = list(self._futures)
        if cancel_futures:
            for future in futures:
                if not future.done():
                    future.cancel()
        if not first:
            if wait:
                self._finished.wait()
            return
        if wait:
            self._finish(futures)
        else:
            threading.Thread(target=self._finish, args=(futures,), name="callreg-shutdown", daemon=True).start()

    def _finish(self, futures: list[concurrent.futures.Future[Any]]) -> None:
        try:
            # Each waited for inline, which starts no thread (at
            # interpreter exit, Python 3.12 and later start none).
            for future in futures:
                if not future.cancelled():
                    try:
                        future.exception()
                    except concurrent.futures.CancelledError:
                        pass
            with self._lock:
                handles = list(self._handles.values())
                self._handles.clear()
                self._seen.clear()
            for handle in handles:
                try:
                    self._worker.unregister(handle)
                except CallregError:
                    pass  # the Worker closes next: nothing is left anyway
        finally:
            self._worker.close()
            self._finished.set()


# The Executors alive, each waited for at interpreter exit.
_LIVE: weakref.WeakSet[Executor] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # An inherited Executor's lock may have been held by a thread of the
    # parent at the fork (a submit registering a callable): a new one, so
    # that its submit, map and shutdown raise or return in the child
    # instead of waiting for a thread that does not exist there.
    for executor in list(_LIVE):
        executor._lock = threading.Lock()


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
        executor.shutdown(wait=True)
