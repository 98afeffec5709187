"""The futures of tasks: each waits for its result inline, or is handed to
its Worker's dispatcher thread (``specs/python.md`` §3)."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, RUNNING
from typing import TYPE_CHECKING, Any, TypeVar

from callreg import _callreg
from callreg._errors import LifecycleError, ResultError
from callreg._raw_errors import error

if TYPE_CHECKING:
    from callreg._callreg import _ErrorFields

_LOGGER = logging.getLogger("callreg")

_T = TypeVar("_T")

# RawPending.wait's answers besides a result: 0, another thread holds
# the task (or it was armed); 1, the time was up.
_PENDING_TIMED_OUT = 1
# How long a waiter sleeps while another thread holds the pending task
# (seconds), before it looks again.
_HELD_SLICE = 0.005


def result_error(error: BaseException) -> BaseException:
    """What a result's ``pickle.loads`` that raised ``error`` raises: a
    :class:`ResultError` (also a ``BrokenProcessPool``, as
    ``ProcessPoolExecutor`` raises then) from ``error``, so that a result
    never ends this process (``sys.exit`` in a ``__reduce__``); a
    ``KeyboardInterrupt`` stays the caller's (``specs/python.md`` §3)."""
    if isinstance(error, KeyboardInterrupt):
        return error
    wrapped = ResultError(
        "the task returned, but its result could not be unpickled in this process: %s: %s"
        % (type(error).__name__, error),
        code="DESERIALIZE_FAILED",
        operation="result",
    )
    wrapped.__cause__ = error
    return wrapped


def _resolve(resolve: Callable[[_T], None], value: _T) -> None:
    """Resolves a future in the dispatcher thread. ``concurrent.futures``
    logs an ``Exception`` raised by a done-callback; a ``BaseException``
    (``SystemExit``, ``KeyboardInterrupt``) would end the dispatcher and
    strand every later future, so it is reported the same way and the
    dispatcher goes on."""
    try:
        resolve(value)
    except BaseException:  # a done-callback's SystemExit or KeyboardInterrupt
        _LOGGER.exception("a done-callback of a callreg future raised")


class Dispatch:
    """Armed futures waiting for results (:meth:`TaskFuture._arm`), and
    the thread that resolves them. Holds no reference to its Worker (so the
    Worker can be garbage-collected)."""

    def __init__(self, raw: _callreg.RawWorker) -> None:
        self.raw = raw
        self.lock = threading.Lock()
        self.futures: dict[int, TaskFuture] = {}
        # Completions taken from the channel and not yet served (read and
        # written by the dispatcher thread alone): a done-callback that
        # waits on another future serves the rest of its batch first.
        self.backlog: collections.deque[tuple[int, bytes | None, _ErrorFields | None]] = collections.deque()
        self.thread: threading.Thread | None = None
        self.closed = False
        # Set in a child forked from the Worker's process: no dispatcher
        # runs there, and every future copied there resolves at once with
        # LIFECYCLE_INVALID (specs/python.md §3, "Forked children").
        self.forked = False
        _DISPATCHES.add(self)

    def start(self) -> None:
        """Starts the thread once (at the first arm)."""
        with self.lock:
            if self.thread is None and not self.closed:
                thread = threading.Thread(target=self.run, name="callreg-dispatch", daemon=True)
                # Set once started: at interpreter exit (Python 3.12 and
                # later) start() raises, and no thread is left to join.
                thread.start()
                self.thread = thread

    def run(self) -> None:
        while self.serve(0.5):
            pass
        self.fail_remaining()

    def serve(self, timeout: float) -> bool:
        """Resolves the futures of the completions there within
        ``timeout`` seconds; ``False`` once the Worker closed and every
        completion was served."""
        backlog = self.backlog
        if not backlog:
            batch = self.raw.next_completions(timeout)
            if batch is None:
                return False
            backlog.extend(batch)
        while backlog:
            task, output, failure = backlog.popleft()
            with self.lock:
                future = self.futures.pop(task, None)
            if future is not None:
                future._resolve(output, failure)
        return True

    def serve_until(self, future: TaskFuture, timeout: float | None) -> None:
        """On the dispatcher thread (a done-callback waiting on another
        armed future): serves completions until ``future`` is done or
        ``timeout`` seconds passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not future.done():
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left < 0 or not self.serve(left):
                return

    def fail_remaining(self) -> None:
        with self.lock:
            left = list(self.futures.values())
            self.futures.clear()
        for future in left:
            if not future.done():
                _resolve(
                    future.set_exception,
                    LifecycleError(
                        "the Worker closed before the task's result arrived",
                        code="LIFECYCLE_INVALID",
                        operation="task",
                    ),
                )


def shutdown(raw: _callreg.RawWorker, dispatch: Dispatch) -> None:
    """Closes a Worker: at :meth:`Worker.close`, garbage collection or exit."""
    with dispatch.lock:
        dispatch.closed = True
    raw.close()
    thread = dispatch.thread
    if thread is not None and thread is not threading.current_thread():
        thread.join()
    dispatch.fail_remaining()


class _ArmingList(list[Any]):
    """A future's waiter list (``concurrent.futures.wait`` and
    ``as_completed`` append to it): a waiter added arms the future, whose
    result must then arrive without an inline wait."""

    __slots__ = ("future",)

    future: weakref.ref[TaskFuture]

    def append(self, waiter: Any) -> None:
        super().append(waiter)
        future = self.future()  # a weak reference: no cycle to collect
        if future is not None:
            future._arm()


# Held while a future's condition is made, and while a resolution looks
# whether it was made and, when not, writes the result and state
# (TaskFuture._resolve): one lock for every future, held for a dict look
# and two writes.
_MADE = threading.Lock()

# Every Dispatch alive, for the fork hook below.
_DISPATCHES: weakref.WeakSet[Dispatch] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a child forked from the process (``os.fork``, a ``fork``
    multiprocessing context, a target): the Workers there are the
    parent's, so every Dispatch is marked forked, and its lock, which a
    thread of the parent may have held at the fork, is a new one."""
    global _MADE
    _MADE = threading.Lock()
    for dispatch in list(_DISPATCHES):
        dispatch.forked = True
        dispatch.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class TaskFuture(concurrent.futures.Future[Any]):
    """The :class:`concurrent.futures.Future` of a task (running from its
    submit). Its first waiter (:meth:`result`, :meth:`exception`) waits for
    the result inline, reading the targets' replies itself, with no other
    thread woken (a second concurrent waiter sleeps in short slices until
    the first resolves it or gives the task back, and looks again); a
    done-callback, a ``concurrent.futures.wait`` or ``as_completed`` on it
    hands it to the Worker's dispatcher thread instead. ``done()`` reads a
    result already there without waiting. :meth:`cancel` stops a task that
    has not started in its target (``specs/protocol.md`` §2.11)."""

    _pending: _callreg.RawPending | None
    # Future.__init__'s fields, as class defaults (an instance writes its
    # own when it changes them).
    _state = RUNNING
    _result: Any = None
    _exception: BaseException | None = None
    # The set that holds the future until it is resolved (an Executor's
    # tasks run to their end when nothing else holds their futures, as
    # ProcessPoolExecutor's do); the resolution takes it out, so the
    # result is then held by whoever holds the future alone.
    _held_by: set[concurrent.futures.Future[Any]] | None = None

    def __init__(self, pending: _callreg.RawPending, dispatch: Dispatch) -> None:
        # Not Future.__init__: the condition, the waiter list and the
        # done-callback list are made when first used (__getattr__), by a
        # waiter in another thread, a done-callback,
        # concurrent.futures.wait or cancel(); the future's own waiter and
        # its resolution need none of them (_resolve).
        self._pending = pending
        # Kept for cancel() while another thread (or the dispatcher) holds
        # the pending task.
        self._task = pending
        self._dispatch = dispatch

    def __getattr__(self, name: str) -> Any:
        # Only for attributes not yet set: the lazy condition and waiter
        # list (dict.setdefault: two threads get the same one). The
        # condition is made under _MADE, which a resolution without it
        # holds while it writes the state (_resolve): so a thread that
        # makes it either reads the state finished under it, or finds the
        # resolution taking it.
        if name == "_condition":
            with _MADE:
                return self.__dict__.setdefault(name, threading.Condition())
        if name == "_done_callbacks":
            return self.__dict__.setdefault(name, [])
        if name == "_waiters":
            waiters = _ArmingList()
            waiters.future = weakref.ref(self)
            return self.__dict__.setdefault(name, waiters)
        raise AttributeError("%r object has no attribute %r" % (type(self).__name__, name))

    def cancel(self) -> bool:
        """Cancels the task if it has not started in its target: ``True``
        when it will never run (the future is then cancelled:
        ``result()`` raises :class:`concurrent.futures.CancelledError`,
        done-callbacks run, ``concurrent.futures.wait`` counts it done);
        ``False`` when it already started or finished (it runs to its end
        and its result comes as usual). Waits for the target's answer (a
        round trip; at most about ``control_timeout`` for a target that
        stopped answering, which is then killed)."""
        with self._condition:
            if self._state in (CANCELLED, CANCELLED_AND_NOTIFIED):
                return True
            if self._state != RUNNING:
                return False
        if self.done():
            return self.cancelled()
        try:
            cancelled = self._dispatch.raw.cancel(self._task)
        except _callreg.RawError:
            return False  # from a completion callback, or another process
        if not cancelled:
            return False
        self._set_cancelled()
        return True

    def _set_cancelled(self) -> None:
        """Cancelled (once): notifies ``concurrent.futures.wait`` waiters
        and runs the done-callbacks in this thread."""
        with self._condition:
            if self._state != RUNNING:
                return
            self._state = CANCELLED_AND_NOTIFIED
            for waiter in self._waiters:
                waiter.add_cancelled(self)
            self._condition.notify_all()
        self._pending = None
        self._release()
        # concurrent.futures' own step after a cancel (not in its stubs).
        _resolve(lambda _: self._invoke_callbacks(), None)

    def _release(self) -> None:
        """Out of the set that held it until now (once resolved)."""
        held = self._held_by
        if held is not None:
            self._held_by = None
            held.discard(self)

    def _resolve(self, output: bytes | None, failure: _ErrorFields | None) -> None:
        """Sets the result (``output``: pickled bytes) or the error (a
        ``RawError`` field dict); done-callbacks run in this thread. A
        task cancelled before it started (``TASK_CANCELLED``) leaves the
        future cancelled."""
        self._pending = None
        self._release()
        if failure is not None and failure["code"] == "TASK_CANCELLED":
            self._set_cancelled()
        elif failure is None:
            try:
                value = pickle.loads(output)  # type: ignore[arg-type]  # a result without error has its output
            except BaseException as exc:  # an unpicklable result
                _resolve(self.set_exception, result_error(exc))
            else:
                # set_result(value), without the condition when it was
                # never made: then no other thread waits on this future
                # or looks at it under the lock, and it has no
                # done-callback or waiter. The look and the writes are
                # one step under _MADE, under which the condition is
                # made: a thread that makes it later reads the state
                # finished under it. Once it exists, the state changes
                # under it, as Future.set_result's does, so a waiter
                # (wait, as_completed) sees the result exactly once.
                # (A task with a result was not cancelled: the state is
                # RUNNING here.)
                with _MADE:
                    if "_condition" not in self.__dict__:
                        self._result = value
                        self._state = FINISHED
                        return
                _resolve(self.set_result, value)
        else:
            _resolve(self.set_exception, error(failure))

    def _arm(self) -> None:
        """Hands the result to the dispatcher thread (once; a no-op when
        another thread waits inline or it is done)."""
        pending = self._pending
        if pending is None:
            return
        dispatch = self._dispatch
        # Never armed in a forked child, where no dispatcher runs.
        if not dispatch.forked:
            # Under the lock the dispatcher pops under: a result sent at
            # once finds the future there.
            with dispatch.lock:
                armed = dispatch.raw.arm(pending)
                if armed:
                    dispatch.futures[pending.id] = self
            if armed:
                self._pending = None
                dispatch.start()
                return
        # Another thread waits inline (it resolves), or the Worker closed,
        # or this is a copy in a forked child (the result,
        # LIFECYCLE_INVALID, is there at once).
        outcome = pending.wait(0)
        if isinstance(outcome, tuple):
            self._resolve(*outcome)

    def _wait_inline(self, deadline: float | None) -> None:
        """Waits until the result is there or ``deadline`` (a
        ``time.monotonic()`` instant, ``None``: no limit) passes: in this
        thread, reading the targets' replies, when no other thread holds
        the pending task; while another does (its own wait, or a look),
        in short slices until it resolves the future or gives the task
        back. On the dispatcher thread itself (a done-callback waiting on
        an armed future) it resolves completions until this one is done."""
        while self._state == RUNNING:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            pending = self._pending
            if pending is None:  # armed: the dispatcher resolves it
                if self._dispatch.forked:
                    # ...except in a forked child, where none runs: the
                    # copy's outcome is LIFECYCLE_INVALID, at once.
                    outcome = self._task.wait(0)
                    if isinstance(outcome, tuple):
                        self._resolve(*outcome)
                elif self._dispatch.thread is threading.current_thread():
                    self._dispatch.serve_until(self, left)
                return
            outcome = pending.wait(left)
            if isinstance(outcome, tuple):
                self._resolve(*outcome)
                return
            if outcome == _PENDING_TIMED_OUT:
                return
            # Held by another thread for now.
            with self._condition:
                if self._state == RUNNING:
                    self._condition.wait(_HELD_SLICE if left is None else min(_HELD_SLICE, left))
            if deadline is not None and time.monotonic() >= deadline:
                return

    def result(self, timeout: float | None = None) -> Any:
        pending = self._pending
        if timeout is None and pending is not None and self._state == RUNNING:
            # _wait_inline's first step, written out: the usual wait.
            outcome = pending.wait(None)
            if type(outcome) is tuple:
                self._resolve(*outcome)
                if self._state == FINISHED and self._exception is None:
                    return self._result
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wait_inline(deadline)
        if self._state == FINISHED and self._exception is None:
            return self._result
        return super().result(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wait_inline(deadline)
        return super().exception(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future[Any]], object]) -> None:
        super().add_done_callback(fn)
        self._arm()

    def done(self) -> bool:
        # A look without waiting: reads a reply already there (no other
        # thread may be reading the targets' replies for it).
        pending = self._pending
        if pending is not None and self._state == RUNNING:
            outcome = pending.wait(0)
            if isinstance(outcome, tuple):
                self._resolve(*outcome)
        return self._state in (CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED)

    def running(self) -> bool:
        return not self.done() and super().running()

    def __repr__(self) -> str:
        self.done()
        return super().__repr__()


def _result_or_cancel(future: concurrent.futures.Future[Any], deadline: float | None) -> Any:
    """``future``'s result, waited for until ``deadline``; the future is
    cancelled when the wait raises (timed out, interrupted, the task
    failed)."""
    try:
        if deadline is None:
            return future.result()
        return future.result(max(0.0, deadline - time.monotonic()))
    except BaseException:
        future.cancel()
        raise


def in_order(futures: list[concurrent.futures.Future[Any]], deadline: float | None, chunked: bool) -> Iterator[Any]:
    """The results of ``futures`` in order (each a list of results when
    ``chunked``), each waited for until ``deadline`` (a
    ``time.monotonic()`` instant, ``None``: no limit); futures not reached
    are cancelled when the iterator stops early (it is closed, a result
    raised, Ctrl-C, the time was up), and so is the one whose wait timed
    out or was interrupted, as ``concurrent.futures`` does: those not
    started never run."""
    try:
        futures.reverse()
        while futures:
            # No local holds a result, a chunk or a future while the
            # iterator waits to be resumed: each result is the caller's
            # alone once yielded, as ProcessPoolExecutor's map does.
            if chunked:
                chunk = _result_or_cancel(futures.pop(), deadline)
                chunk.reverse()
                while chunk:
                    yield chunk.pop()
                del chunk
            else:
                yield _result_or_cancel(futures.pop(), deadline)
    finally:
        # The last submitted first: they are the least likely to have
        # started.
        for future in futures:
            future.cancel()
        futures.clear()
