"""The package's exception classes (re-exported by ``callreg``)."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures.process import BrokenProcessPool
from typing import Any


class CallregError(Exception):
    """A failed callreg operation.

    ``code`` is the error code (e.g. ``"REGISTER_PARTIAL_FAILURE"``);
    ``operation`` what was being done (``"register"``, ``"task"``, ...);
    ``target`` the target id, ``hashid`` the callable's hashid and ``seq``
    the operation's sequence number, each ``None`` where not applicable.
    ``str()`` is the full message."""

    code: str
    operation: str | None
    target: int | None
    hashid: str | None
    seq: int | None

    def __init__(
        self,
        message: str,
        *,
        code: str,
        operation: str | None = None,
        target: int | None = None,
        hashid: str | None = None,
        seq: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.operation = operation
        self.target = target
        self.hashid = hashid
        self.seq = seq

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable with every field (a task's exception travels pickled,
        # e.g. a TargetLostError from an orchestration callable's inner
        # Worker).
        return (_rebuild_error, (type(self), str(self), dict(self.__dict__)))


class RegisterError(CallregError):
    """A register (or unregister) failed; ``outcomes`` maps every target id
    in its scope to what it did (``"ok"``, ``"failed (CODE: message)"``,
    ``"rolled back"``, ``"lost"``, ...). After a partial failure the register
    was rolled back everywhere: the Worker stays usable. Code
    ``"REGISTER_POISONED"``: installing the callable killed the target that
    tried it first (``target``; the message says how it died); it is
    refused from then on without reaching any target. ``outcome_codes``
    maps each target whose reply was an error to that error's code
    (``"LOCAL_SLOT_EXHAUSTED"``, ...): what a program decides by, never the
    text of ``outcomes``."""

    outcomes: dict[int, str]
    outcome_codes: dict[int, str]

    def __init__(
        self,
        message: str,
        *,
        outcomes: Mapping[int, str] | None = None,
        outcome_codes: Mapping[int, str] | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(message, **fields)
        self.outcomes = dict(outcomes or {})
        self.outcome_codes = dict(outcome_codes or {})

    def refused_for(self, code: str) -> bool:
        """Whether ``code`` is this error's code or a target's reply's."""
        return self.code == code or code in self.outcome_codes.values()


class HandleError(CallregError):
    """A handle was refused: ``code`` is ``"HANDLE_FOREIGN"`` (not issued by
    this Worker, or not a handle at all), ``"HANDLE_STALE"`` (unregistered),
    ``"HANDLE_MUTATED"`` or ``"HANDLE_WRONG_NAMESPACE"``."""


class TargetLostError(CallregError, BrokenProcessPool):
    """The target died or was stopped after the task started there and
    before its result arrived (a task it never started runs on another
    target, ``specs/protocol.md`` §2.15), or there is no live target
    (``code`` ``"TARGET_LOST"`` or ``"NO_LIVE_TARGET"``). Raised by :meth:`Worker.start` when a target
    did not start, and by :meth:`Worker.unregister` when a target was lost
    while it dropped the handle (the handle is released all the same),
    with ``outcomes`` (as :class:`RegisterError`'s; empty for a task).

    Also a :class:`concurrent.futures.process.BrokenProcessPool` (so a
    ``RuntimeError``), as what ``ProcessPoolExecutor`` raises when a
    worker dies, so that ``except BrokenProcessPool`` clauses keep
    working; unlike that pool's, a Worker or Executor stays usable (the
    target is replaced)."""

    outcomes: dict[int, str]

    def __init__(self, message: str, *, outcomes: Mapping[int, str] | None = None, **fields: Any) -> None:
        super().__init__(message, **fields)
        self.outcomes = dict(outcomes or {})


class LifecycleError(CallregError):
    """Not allowed in the Worker's state: not started yet, already closed,
    or closed while the task was pending. ``code`` ``"LIFECYCLE_INVALID"``.
    (A Worker's option values the crate's builder refuses raise
    ``ValueError`` when the Worker is made.)"""


class TaskTimeoutError(CallregError, TimeoutError):
    """A task passed its deadline (``timeout=`` of :meth:`Worker.submit`,
    :meth:`Worker.call`, ``task_timeout=`` of :meth:`Worker.map`, or
    :func:`callreg.options` with the Executor): ``code``
    ``"TASK_DEADLINE"``: it ran longer than its timeout, counted from its
    start in its target. Its target was killed (and is replaced, with
    replacements on); the tasks queued behind it there never started and
    run on another target (``specs/protocol.md`` §2.12, §2.15). Also a
    :class:`TimeoutError`."""


class EnvelopeError(CallregError):
    """Bytes are not a valid SPYC envelope (``code`` ``"ENVELOPE_INVALID"``)."""


class TaskError(CallregError):
    """A task failed with an exception that cannot be raised here as
    itself (``code`` ``"TASK_FAILED"``): it could not be pickled in the
    target or unpickled here, or it is a :class:`CallregError` raised
    inside the task (an inner Worker's :class:`TargetLostError`, which
    must not pass for a loss of this Worker's target); and its subclass
    :class:`TaskInputError`. ``remote_type`` is the exception's type name
    as the target saw it (``"mymodule.MyError"``),
    ``remote_traceback`` its traceback as ``traceback.format_exception``
    formats it, or ``None``; ``__cause__`` is the exception itself when it
    unpickled here. ``str()`` gives the type, message, target and hashid.

    Every other exception a task raises is raised by ``result()``,
    :meth:`Worker.call` and the ``map`` iterators as itself (its own type,
    ``args`` and attributes; a ``SystemExit`` or ``KeyboardInterrupt``
    too, as ``ProcessPoolExecutor`` raises them), with a
    :class:`RemoteTraceback` as ``__cause__``; ``except TaskError`` does
    not catch it (``specs/python.md`` §3, "Task exceptions")."""

    remote_type: str | None
    remote_traceback: str | None

    def __init__(
        self,
        message: str,
        *,
        remote_type: str | None = None,
        remote_traceback: str | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(message, **fields)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class TaskInputError(TaskError, BrokenProcessPool):
    """The target could not unpickle a task's input (its arguments; a
    class missing there, a ``__reduce__`` that raises or exits):
    ``remote_type`` ``"TaskInputInvalid"``, the message says what
    unpickling raised. The task did not run; the target stays usable
    (it did not run anything). Also a
    :class:`concurrent.futures.process.BrokenProcessPool`, what
    ``ProcessPoolExecutor`` raises then (its worker dies of it)."""


class ResultError(CallregError, BrokenProcessPool):
    """The task returned, but its pickled result could not be unpickled
    in this process (a class missing here, a ``__reduce__`` that raises,
    or one that calls ``sys.exit``): ``code`` ``"DESERIALIZE_FAILED"``,
    ``operation`` ``"result"``; ``__cause__`` is what unpickling raised.
    Raised by ``result()``, :meth:`Worker.call` and the ``map``
    iterators; the Worker stays usable. Also a
    :class:`concurrent.futures.process.BrokenProcessPool`, what
    ``ProcessPoolExecutor`` raises then (its result thread dies of it). A
    ``KeyboardInterrupt`` while unpickling stays the caller's."""


class RemoteTraceback(Exception):
    """The ``__cause__`` of a task's exception raised here: its ``str()``
    is the traceback the target formatted (exception line and chained
    causes included, frames of code pickled by value naming the file and
    line where it was defined), so a traceback printed here shows where
    the task raised. ``target``, ``hashid`` and ``seq`` say which target
    ran which callable in which task (``None`` where not known);
    ``remote_type`` is the exception's type name as the target saw it."""

    text: str
    target: int | None
    hashid: str | None
    seq: int | None
    remote_type: str | None

    def __init__(
        self,
        text: str,
        *,
        target: int | None = None,
        hashid: str | None = None,
        seq: int | None = None,
        remote_type: str | None = None,
    ) -> None:
        super().__init__(text)
        self.text = text
        self.target = target
        self.hashid = hashid
        self.seq = seq
        self.remote_type = remote_type

    def __str__(self) -> str:
        return self.text

    @property
    def tb(self) -> str:
        """:attr:`text`, by the name ``ProcessPoolExecutor``'s remote
        traceback gives it."""
        return self.text

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_traceback, (self.text, dict(self.__dict__)))


def _rebuild_traceback(text: str, fields: dict[str, Any]) -> RemoteTraceback:
    cause = RemoteTraceback(text)
    cause.__dict__.update(fields)
    return cause


def _rebuild_error(cls: type[CallregError], message: str, fields: dict[str, Any]) -> CallregError:
    error = Exception.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(fields)
    return error
