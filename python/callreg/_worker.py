"""The Worker: a parent of forked targets, its registrations and its
tasks."""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import numbers
import pickle
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, ParamSpec, TypeVar, cast

from callreg import _callreg
from callreg._callables import callable_name, check_registrable, default_metadata, merge_metadata, metadata_json
from callreg._codes import CODES
from callreg._envelope import EnvelopeWriter, chunk_input, hashid, task_input
from callreg._errors import HandleError, RegisterError
from callreg._futures import Dispatch, TaskFuture, in_order, result_error, shutdown
from callreg._handle import Handle, raw_handle
from callreg._inspection import Inspection
from callreg._options import (
    DEFAULT_CONTROL_TIMEOUT,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_RESPAWN_BACKOFF,
    DEFAULT_RESPAWN_LIMIT,
    DEFAULT_SLOT_CAPACITY,
    DEFAULT_SPIN,
    checked_seconds,
    raw_worker,
)
from callreg._raw_errors import error, raise_error
from callreg._tree import NextLevel, counts, initialize_target

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _other_threads() -> int:
    """The Python threads of this process but the calling one and
    callreg's own (the dispatcher and shutdown threads of Workers, which
    hold no lock a target uses, ``specs/python.md`` §2)."""
    current = threading.current_thread()
    return sum(1 for t in threading.enumerate() if t is not current and not t.name.startswith("callreg-"))


class Worker(Inspection):
    """A parent with ``targets`` forked child processes (``None``: one per
    CPU, ``os.cpu_count()``), not started until :meth:`start`::

        with callreg.Worker(4) as w:
            w.start()
            h = w.register(lambda x: x * 3)   # installed in every target
            w.call(h, 14)                     # 42, on one target
            w.call_all(h, 1)                  # {0: 3, 1: 3, 2: 3, 3: 3}
            w.submit(h, 2).result()           # 6, a concurrent.futures.Future

    For a drop-in ``concurrent.futures.Executor`` (callables given with
    each task, registered once), see :class:`Executor`.

    ``control_timeout`` (seconds): how long a target may stay silent about
    a register or unregister it has not answered yet (a live target reports
    each alive on receipt and every quarter of this while it is queued or
    running, even while a task holds the GIL), and how long it has to be
    ready at start. ``operation_timeout`` (seconds; ``None``: 10 times
    ``control_timeout``): how long a register or unregister may take in
    all, even from a target that keeps reporting alive (an unpickle that
    never ends); past either the target is killed and lost. ``slot_capacity``:
    callables a target holds at once. ``max_frame_bytes``: bound on one
    task's pickled arguments and on its pickled result
    (:data:`DEFAULT_MAX_FRAME_BYTES`). ``probe_first`` (default ``True``):
    a callable no target has installed yet goes to one target first and to
    the others once that target installed it, so a callable whose
    unpickling kills its process (``os._exit``, a segfault) costs one
    target; it is then refused for the Worker's life with a
    :class:`RegisterError` of code ``"REGISTER_POISONED"`` naming the target
    and how it died. ``False``: every register goes to every target at once
    (one round trip less for a new callable).

    Replacement targets: a target that is lost (it crashed, was killed, or
    missed a deadline) is replaced by a new process with the same id and
    the next incarnation (:meth:`target_incarnation`), forked from a
    template process made at :meth:`start`; it is given every live
    callable and serves (is in :attr:`targets` again) once it installed
    them all. ``respawn_limit`` (default 3; 0: no replacements) is how many
    replacements of one target in a row may be lost before they join (a
    callable that kills every new process); after that the target stays lost
    and :meth:`target_events` says so. ``respawn_backoff`` (seconds, default
    0.1) is the wait before the second replacement in a row, doubling for
    each further one; the first comes at once. ``max_tasks_per_target``
    (default 0: no bound; ``ProcessPoolExecutor``'s ``max_tasks_per_child``)
    is how many tasks one target process is sent: a process sent them
    takes no more, and once they ended it is killed and replaced (a
    ``"retired"`` event in :meth:`target_events`; it counts against no
    limit). A task no target can take meanwhile waits in the Worker and
    goes to the first target that joins (``specs/protocol.md`` §2.14).
    It needs replacements (``respawn_limit`` above 0); once they end (the
    template process is gone) the processes serve on.
    ``spin`` (seconds, default 50 µs, at most 0.001, kept in whole
    nanoseconds, so ``numpy.float32(1e-3)`` is the bound; 0: never): how long a
    caller waiting for its own result (:meth:`call`, a future's
    ``result()``) polls for the reply before it sleeps, and how long each
    target, having sent a result and having no task queued, looks for its
    next task before it sleeps. Waking a sleeping thread on an idle CPU can
    cost more than a short task's whole round trip; the Worker (for its
    callers) and each target (for itself) measure, every 4,096 waits, a
    stretch of waits that spin against one that does not, and spin until
    the next measure only while spinning is faster by more than an eighth.
    An idle Worker and its idle targets never spin (``specs/threads.md``,
    "The leader's spin" and "The target's spin").

    The template process is a child of this process: killing it kills
    every replacement it forked and ends replacements for the Worker's
    life (the targets forked at start serve on).

    Next-level targets: with ``next_level`` (a :class:`NextLevel`), the
    Worker also has ``next_level_targets`` (default 1) next-level targets:
    ids ``0 .. targets-1`` are SUB targets (``targets`` may then be 0),
    ids ``targets .. targets+next_level_targets-1`` next-level targets.
    Each next-level target is a child process that builds its own inner
    Worker as ``next_level`` says, runs its ``setup``, starts it, then
    serves this Worker like any target: a callable registered here is
    installed in every live target of both kinds (one operation, one
    scope, rolled back everywhere when any target fails), and on a
    next-level target it is called as ``fn(ctx, *args, **kwargs)`` with
    its :class:`Context` (``ctx.inner``, ``ctx.handles``). A register here
    never reaches an inner Worker's registry. A task with ``target=None``
    goes to any live target of either kind: pass ``target=`` (see
    :attr:`sub_targets`, :attr:`next_level_targets`) when both kinds run
    different callables. When a next-level target dies, its inner
    targets die with it (the kernel's parent-death signal) and it is a
    lost target here; an inner target's death is the inner Worker's
    (a :class:`TargetLostError` in the orchestration callable).

    ``initializer(*initargs)`` (as :class:`concurrent.futures.ProcessPoolExecutor`'s)
    runs in every target, and in every replacement, at its start, before
    it serves (with next-level targets: before their ``setup``); if it
    raises, that target is lost at start (:meth:`start` raises
    :class:`TargetLostError`; a replacement is retried as for any loss).

    ``start_method`` (``specs/python.md``, "Start methods"): ``"fork"``
    (the default) forks the targets from this interpreter at
    :meth:`start`: they inherit its imported modules and state, and also
    any lock another thread of this process holds at that moment, which
    stays held in every target (a deadlock there); :meth:`start` warns
    (``RuntimeWarning``) when other threads run. ``"forkserver"`` starts
    a fresh interpreter (``sys.executable``, with this process's
    ``sys.path``, working directory and environment) that imports each
    module named in ``preload`` and then forks every target, those of the
    start and every replacement: nothing of this process's threads, locks
    or memory reaches a target. The ``initializer`` (with ``initargs``)
    and ``next_level`` are then pickled with cloudpickle into that
    interpreter. ``preload`` needs ``"forkserver"``.

    Made with an option of the wrong type it raises ``TypeError``; with a
    value it cannot run, ``ValueError`` naming the option: fewer than one
    target or slot, ``max_frame_bytes`` below 256, a time that is not
    positive and finite (``respawn_backoff`` may be zero), an
    ``operation_timeout`` shorter than ``control_timeout``, or
    ``max_tasks_per_target`` with ``respawn_limit=0``
    (``specs/python.md``, "Options").

    Thread-safe: any number of threads may submit at once. A context
    manager: leaving a ``with`` block closes it."""

    def __init__(
        self,
        targets: int | None = None,
        *,
        next_level: NextLevel | None = None,
        next_level_targets: int | None = None,
        control_timeout: float = DEFAULT_CONTROL_TIMEOUT,
        slot_capacity: int = DEFAULT_SLOT_CAPACITY,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        operation_timeout: float | None = None,
        probe_first: bool = True,
        respawn_limit: int = DEFAULT_RESPAWN_LIMIT,
        respawn_backoff: float = DEFAULT_RESPAWN_BACKOFF,
        max_tasks_per_target: int = 0,
        spin: float = DEFAULT_SPIN,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[Any] = (),
        start_method: Literal["fork", "forkserver"] = "fork",
        preload: Iterable[str] = (),
    ) -> None:
        sub, total = counts(targets, next_level, next_level_targets)
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable or None, not %s" % type(initializer).__name__)
        initargs = tuple(initargs)
        target_initializer = None
        if initializer is not None or next_level is not None:
            target_initializer = functools.partial(initialize_target, initializer, initargs, sub, next_level)
        self._raw = raw_worker(
            total,
            control_timeout=control_timeout,
            slot_capacity=slot_capacity,
            max_frame_bytes=max_frame_bytes,
            operation_timeout=operation_timeout,
            probe_first=probe_first,
            respawn_limit=respawn_limit,
            respawn_backoff=respawn_backoff,
            max_tasks_per_target=max_tasks_per_target,
            spin=spin,
            target_initializer=target_initializer,
            start_method=start_method,
            preload=preload,
        )
        self._start_method = start_method
        self._count = int(total)
        self._slot_capacity = int(slot_capacity)
        self._control_timeout = float(control_timeout)
        self._sub = int(sub)
        # Handles registered before start (None once started).
        self._prestart: list[Handle[..., Any]] | None = []
        self._dispatch = Dispatch(self._raw)
        self._closed = False
        self._finalizer = weakref.finalize(self, shutdown, self._raw, self._dispatch)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False

    def __repr__(self) -> str:
        if self._closed:
            state = "closed"
        elif self._prestart is not None:
            state = "not started"
        else:
            state = "live targets %s" % (self.targets,)
        return "<callreg.Worker of %d target%s, %s>" % (self._count, "" if self._count == 1 else "s", state)

    # -- registration --------------------------------------------------

    def register(
        self, fn: Callable[_P, _R], *, metadata: Mapping[str, Any] | None = None, out_of_band: bool = True
    ) -> Handle[_P, _R]:
        """Registers ``fn`` (any callable cloudpickle can pickle) and returns
        its :class:`Handle`. The side-car metadata (this interpreter's and
        cloudpickle's versions, the callable's name) is filled in and
        ``metadata`` (a dict in the ``specs/metadata.md`` form: ``name``,
        ``executor``, ``executor_data``, ``deps``, ``call_before``,
        ``call_after``; a hook's ``"hashid"`` may be a :class:`Handle`) is
        merged over it. Before :meth:`start` it joins the startup snapshot;
        after, it returns once every live target installed it.

        A callable registered again with the same metadata gets a second
        handle; while it is registered, a register of it with other
        metadata is refused (:class:`CallregError`, ``METADATA_CONFLICT``,
        naming both): unregister every handle of it first.

        Large buffers ``fn`` captures (numpy arrays, ``pickle.PickleBuffer``:
        what pickle protocol 5 sends out of band, from
        :data:`callreg.OUT_OF_BAND_MIN_BYTES` up) are not copied into each
        target: every target maps them copy-on-write from one sealed memory
        file (``specs/formats.md`` §1.1), so such an array's memory is
        counted once, however many targets there are, for a register after
        :meth:`start`, and a task may write into it: the page it writes
        becomes its target's own, never seen by another target (one
        registered before :meth:`start` reaches the targets by ``fork``,
        as bytes: each target then holds its own writable copies). Which
        arrays go out of band is numpy's choice (contiguous ones of plain
        dtypes; ``docs/identity.md``). ``out_of_band=False``
        pickles them into the callable's pickle instead, as the reference
        form (version 1) does; its hashid then differs.

        Raises ``TypeError`` for a non-callable or an ``async def``
        function, ``MemoryError`` when the system has no memory to stage
        its pickle (nothing was sent; the Worker stays usable),
        :class:`RegisterError` (``.outcomes`` per target) when a
        target failed to install it (rolled back), :class:`CallregError`
        (``METADATA_INVALID``) for bad metadata or (``METADATA_CONFLICT``)
        for other metadata than it is registered with,
        :class:`LifecycleError` once closed. Ctrl-C while it waits raises
        ``KeyboardInterrupt`` at once; the register goes on in the
        targets, and what it installs is unregistered when it completes."""
        check_registrable(fn, "register")
        meta = merge_metadata(default_metadata(callable_name(fn)), metadata)
        # Pickled once, straight where the targets read it when large.
        writer = EnvelopeWriter()
        try:
            writer.dump(fn, out_of_band=out_of_band)
            if writer.fd is None:
                raw = self._register(writer.envelope(), meta)
            else:
                raw = self._register_memfd(writer.finish(), meta, writer.payload_sha256)
        finally:
            writer.close()
        # The handle of a callable of this signature.
        handle = cast("Handle[_P, _R]", raw)
        CODES.record(fn)
        return handle

    def register_envelope(
        self, data: bytes | bytearray | memoryview, *, metadata: Mapping[str, Any] | None = None
    ) -> Handle[..., Any]:
        """Registers a pre-packed SPYC envelope (e.g. from ``callreg pack``
        or :func:`pack`) with ``metadata`` (a dict, or ``None`` for none:
        nothing is filled in, the packer's versions are unknown here).

        Raises ``TypeError`` unless ``data`` is bytes-like,
        :class:`EnvelopeError` for invalid bytes, then as :meth:`register`."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError("register_envelope() takes bytes, not %s" % type(data).__name__)
        return self._register(bytes(data), merge_metadata(None, metadata))

    def _register(self, envelope: bytes, meta: Mapping[str, Any] | None) -> Handle[..., Any]:
        return self._published(lambda text: self._raw.register(envelope, text), meta)

    def _register_memfd(
        self, fd: int, meta: Mapping[str, Any] | None, payload_sha256: bytes | None = None
    ) -> Handle[..., Any]:
        return self._published(lambda text: self._raw.register_memfd(fd, text, payload_sha256), meta)

    def _published(
        self, register: Callable[[str | None], _callreg.RawHandle], meta: Mapping[str, Any] | None
    ) -> Handle[..., Any]:
        text = None if meta is None else metadata_json(meta)
        try:
            raw = register(text)
        except _callreg.RawError as failure:
            fields = failure.args[0]
            if fields.get("operation") == "stage" and str(fields.get("message", "")).startswith("out of memory"):
                raise MemoryError("no memory to stage the callable's pickle: %s" % fields["message"]) from None
            raise_error(failure)
        handle = Handle._of(raw)
        if self._prestart is not None:
            # Before start: start() maps failed snapshot entries back to it.
            self._prestart.append(handle)
        return handle

    def unregister(self, handle: Handle[..., Any]) -> None:
        """Unregisters ``handle``; returns once every target dropped it.
        Raises :class:`HandleError` for a foreign or stale handle,
        :class:`RegisterError` when a target refused to drop it or did not
        answer in time (``UNREGISTER_PARTIAL_FAILURE``), and
        :class:`TargetLostError` (``TARGET_LOST``) when a target was lost
        while it dropped it, e.g. a finalizer the release ran ended the
        process: the handle is released all the same (a lost target holds
        nothing), and the message says how each lost target ended
        (``specs/protocol.md`` §2.3)."""
        raw = raw_handle(handle)
        try:
            self._raw.unregister(raw)
        except _callreg.RawError as failure:
            raise_error(failure)

    def forgive(
        self, callable_or_hashid: str | bytes | bytearray | memoryview | Handle[..., Any] | Callable[..., Any]
    ) -> bool:
        """Clears the poison of a callable (its hashid, a :class:`Handle`,
        envelope bytes or the callable itself): its next :meth:`register`
        tries it again on one target (``specs/protocol.md`` §2.8). A
        callable is poisoned when the target that tried it first died
        while installing it, or was still busy with it at the operation
        bound; forgive it when that was not its fault (an external kill,
        memory pressure). Returns whether it was poisoned. Raises
        ``ValueError`` for a string that is not a hashid, and
        :class:`LifecycleError` in a child forked from the Worker's
        process."""
        if isinstance(callable_or_hashid, str):
            name = callable_or_hashid
        else:
            name = hashid(callable_or_hashid)
        try:
            return self._raw.forgive(name)
        except _callreg.RawError as failure:
            raise_error(failure)

    # -- lifecycle -----------------------------------------------------

    def start(self) -> dict[Handle[..., Any], RegisterError]:
        """Forks the targets from this interpreter (see the module docs), or
        under ``start_method="forkserver"`` starts the template interpreter
        and has it fork them, and waits until each installed the startup
        snapshot.

        Returns the pre-start registrations that failed, as a dict
        ``{Handle: RegisterError}`` (empty when every one was installed): a
        callable of the startup snapshot that some target could not install
        (it failed to unpickle, or its version or dependency check refused
        it) fails its registration only. Its handle is no longer live
        (:class:`HandleError`, ``HANDLE_STALE``), every target that did
        install it drops it, the error's ``outcomes`` give each failing
        target's reason (code, Python type and message), and the Worker
        starts with the rest.

        Under ``start_method="fork"`` with other threads running in this
        process (Python threads but the caller and callreg's own) it warns
        first
        (``RuntimeWarning``): a lock such a thread holds now stays held in
        every target; ``start_method="forkserver"`` has no such hazard.

        Raises :class:`LifecycleError` unless new, :class:`RegisterError`
        or :class:`TargetLostError` when a target did not start (the Worker
        then serves with the others), :class:`CallregError` (``IO_FAILED``)
        when the template process of ``"forkserver"`` did not start (its
        message names a ``preload`` module that failed to import and its
        exception)."""
        return self._start(2)

    def _start(self, stacklevel: int) -> dict[Handle[..., Any], RegisterError]:
        """:meth:`start`, warning at ``stacklevel`` (the caller's frame)."""
        threads = _other_threads()
        if self._start_method == "fork" and self._prestart is not None and threads:
            warnings.warn(
                "callreg.Worker.start() forks its targets while this process runs %d other threads: a "
                "lock another thread holds now stays held in every target; start the Worker before any "
                'thread, or use start_method="forkserver"' % threads,
                RuntimeWarning,
                stacklevel=stacklevel + 1,
            )
        prestart, self._prestart = self._prestart, None
        try:
            failed = self._raw.start()
        except _callreg.RawError as failure:
            raise_error(failure)
        by_id = {h._raw.handle_id: h for h in prestart or ()}
        # Each a REGISTER_PARTIAL_FAILURE: a RegisterError.
        return {
            by_id[handle_id]: cast(RegisterError, error(fields)) for handle_id, fields in failed if handle_id in by_id
        }

    def close(self) -> None:
        """Closes the Worker: pending futures fail with
        :class:`LifecycleError`, targets are stopped and reaped, staged
        payloads are removed. Idempotent."""
        self._closed = True
        self._finalizer()

    # -- tasks ---------------------------------------------------------

    # The target= keyword cannot join a ParamSpec: arguments are checked
    # by call_all and Executor.submit, the result type everywhere.
    def submit(
        self,
        handle: Handle[..., _R],
        /,
        *args: Any,
        target: int | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> concurrent.futures.Future[_R]:
        """Runs ``handle(*args, **kwargs)`` on ``target`` (any live target
        when ``None``, in turn) and returns a
        :class:`concurrent.futures.Future` of its result (running at once:
        its ``cancel()`` stops it only until it starts in its target,
        ``specs/protocol.md`` §2.11). ``timeout`` (seconds, ``None``: none)
        is how long the task may run once its target started it (time
        queued behind other tasks does not count): past it the task fails
        with :class:`TaskTimeoutError` and its target is killed (and
        replaced); the tasks queued behind it there never started, and run
        on another target (§2.12, §2.15). ``target`` and ``timeout`` are the task's options, never
        the callable's: register ``functools.partial(fn, timeout=...)``
        for a callable that takes keywords of those names. The future
        fails with :class:`TaskError`, :class:`TaskTimeoutError`,
        :class:`TargetLostError`, :class:`HandleError` or
        :class:`LifecycleError`.

        The first thread that waits on the future (``result()``,
        ``exception()``) reads the result itself, as :meth:`call` does;
        done-callbacks run in the thread that resolves the future (that
        waiter, or the Worker's dispatcher thread for a future with
        done-callbacks or in ``concurrent.futures.wait`` that nobody waits
        on)."""
        if isinstance(handle, Handle):
            raw = handle._raw
        elif callable(handle):
            raise HandleError(
                "submit() takes a Handle; register %s first (h = w.register(fn)), or use "
                "callreg.Executor, whose submit takes the callable" % callable_name(handle),
                code="HANDLE_FOREIGN",
                operation="resolve",
            )
        else:
            raw = raw_handle(handle)
        if target is not None:
            target = self._target(target)
        if timeout is not None:
            timeout = checked_seconds("timeout", timeout)
        return self._submit(raw, target, task_input(args, kwargs), timeout)

    def _submit(
        self, raw: _callreg.RawHandle, target: int | None, data: bytes, timeout: float | None = None
    ) -> concurrent.futures.Future[Any]:
        """The future of a task of raw handle ``raw`` with pickled input
        ``data`` on ``target`` (checked; ``None``: any), with deadline
        ``timeout`` (seconds; ``None``: none). Raises ``ValueError`` for a
        ``timeout`` that is not a positive number of seconds."""
        try:
            pending = self._raw.submit(raw, target, data, timeout)
        except _callreg.RawError as failure:
            return _failed(failure)
        return TaskFuture(pending, self._dispatch)

    def call(
        self,
        handle: Handle[..., _R],
        /,
        *args: Any,
        target: int | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> _R:
        """``submit(handle, *args, target=target, timeout=timeout,
        **kwargs).result()``, waiting without the dispatcher thread. Ctrl-C
        while it waits raises :class:`KeyboardInterrupt` here; the Worker
        stays usable (the task runs on)."""
        raw = raw_handle(handle)
        target = self._target(target)
        if timeout is not None:
            timeout = checked_seconds("timeout", timeout)
        data = task_input(args, kwargs)
        try:
            output = self._raw.call(raw, target, data, timeout)
        except _callreg.RawError as failure:
            raise_error(failure)
        try:
            result: _R = pickle.loads(output)
        except BaseException as exc:  # an unpicklable result
            unpickling = result_error(exc)
            raise unpickling from unpickling.__cause__
        return result

    def call_all(self, handle: Handle[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> dict[int, _R]:
        """Runs the task on every live target; returns ``{target id:
        result}`` in target order. Raises the first failure (in target
        order) once every target answered; :class:`TargetLostError`
        (``NO_LIVE_TARGET``) when no target is live."""
        raw = raw_handle(handle)
        data = task_input(args, kwargs)
        targets = self.targets
        if not targets:
            # Raises what a call raises then: NO_LIVE_TARGET once started,
            # LIFECYCLE_INVALID before start or after close.
            try:
                self._raw.call(raw, None, data)
            except _callreg.RawError as failure:
                raise_error(failure)
        futures = {t: self._submit(raw, t, data) for t in targets}
        results: dict[int, _R] = {}
        first: BaseException | None = None
        for target, future in futures.items():
            try:
                results[target] = future.result()
            except BaseException as error:
                if first is None:
                    first = error
        if first is not None:
            raise first
        return results

    def map(
        self,
        handle: Handle[..., _R],
        /,
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        task_timeout: float | None = None,
    ) -> Iterator[_R]:
        """Like :meth:`concurrent.futures.Executor.map`: submits
        ``handle(*items)`` for each tuple of items at once, spread over the
        live targets, and returns an iterator of the results in order;
        ``timeout`` (seconds from this call) raises
        :class:`concurrent.futures.TimeoutError` for a result not there in
        time. ``chunksize`` items go in one task (one frame each way, the
        calls run in turn in one target, ``specs/python.md`` §3): a call
        that raises fails its chunk, and the iterator raises that error
        when it reaches the chunk. ``task_timeout`` is each task's (each
        chunk's) deadline, as :meth:`submit`'s ``timeout``. When the
        iterator stops early (a result raised, it was closed, Ctrl-C, the
        time was up) the tasks not yet started are cancelled and never
        run. Raises ``ValueError`` unless ``chunksize >= 1``."""
        return self._map(raw_handle(handle), iterables, timeout, chunksize, task_timeout)

    def _map(
        self,
        raw: _callreg.RawHandle,
        iterables: Iterable[Iterable[Any]],
        timeout: float | None,
        chunksize: int,
        task_timeout: float | None = None,
        track: Callable[[concurrent.futures.Future[Any]], None] | None = None,
    ) -> Iterator[Any]:
        """The results of ``map``; ``track``, when given, is called with
        each future made."""
        if isinstance(chunksize, bool) or not isinstance(chunksize, numbers.Integral):
            raise TypeError("chunksize must be an int, not %s" % type(chunksize).__name__)
        chunksize = int(chunksize)
        if task_timeout is not None:
            task_timeout = checked_seconds("task_timeout", task_timeout)
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1, got %d" % chunksize)
        deadline = None if timeout is None else time.monotonic() + timeout
        calls = zip(*iterables, strict=False)  # as map: the shortest ends it
        futures = []
        while True:
            if chunksize == 1:
                items = next(calls, None)
                if items is None:
                    break
                make: Callable[[Any], bytes] = lambda items: task_input(items, {})  # noqa: E731
            else:
                items = list(itertools.islice(calls, chunksize))
                if not items:
                    break
                make = chunk_input
            try:
                data = make(items)
            except Exception as failure:  # an argument cannot be pickled: its result() raises
                futures.append(_failed_with(failure))
            else:
                futures.append(self._submit(raw, None, data, task_timeout))
        if track is not None:
            for future in futures:
                track(future)
        return in_order(futures, deadline, chunksize != 1)


def _failed(failure: _callreg.RawError) -> concurrent.futures.Future[Any]:
    """A future failed at once with ``failure``'s error (a task refused at
    submit)."""
    return _failed_with(error(failure))


def _failed_with(exception: BaseException) -> concurrent.futures.Future[Any]:
    """A future failed at once with ``exception``."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    future.set_exception(exception)
    return future
