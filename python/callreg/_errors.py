"""The package's exception classes (re-exported by ``callreg``)."""

from __future__ import annotations

from collections.abc import Mapping
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
    refused from then on without reaching any target."""

    outcomes: dict[int, str]

    def __init__(self, message: str, *, outcomes: Mapping[int, str] | None = None, **fields: Any) -> None:
        super().__init__(message, **fields)
        self.outcomes = dict(outcomes or {})


class HandleError(CallregError):
    """A handle was refused: ``code`` is ``"HANDLE_FOREIGN"`` (not issued by
    this Worker, or not a handle at all), ``"HANDLE_STALE"`` (unregistered),
    ``"HANDLE_MUTATED"`` or ``"HANDLE_WRONG_NAMESPACE"``."""


class TargetLostError(CallregError):
    """The target died or was stopped before the task's result arrived, or
    there is no live target (``code`` ``"TARGET_LOST"`` or
    ``"NO_LIVE_TARGET"``). Raised by :meth:`Worker.start` when a target
    did not start, and by :meth:`Worker.unregister` when a target was lost
    while it dropped the handle (the handle is released all the same),
    with ``outcomes`` (as :class:`RegisterError`'s; empty for a task)."""

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
    ``"TASK_DEADLINE"``. Its target was killed (and is replaced, with
    replacements on), so every other task running or queued there fails
    with :class:`TargetLostError` (``specs/protocol.md`` §2.12). Also a
    :class:`TimeoutError`."""


class EnvelopeError(CallregError):
    """Bytes are not a valid SPYC envelope (``code`` ``"ENVELOPE_INVALID"``)."""


class TaskError(CallregError):
    """The task raised (``code`` ``"TASK_FAILED"``): ``remote_type`` is the
    exception's type name as the target saw it (``"ZeroDivisionError"``,
    ``"mymodule.MyError"``), ``remote_traceback`` its traceback as
    ``traceback.format_exception`` formats it (chained causes included;
    frames of code pickled by value name the file and line where it was
    defined) or ``None``.

    When the exception unpickles here, what is raised is an instance of a
    class derived from both ``TaskError`` and the exception's type (named
    as that type; ``str()``, ``args`` and attributes are the original's),
    with a :class:`RemoteTraceback` as ``__cause__``. It is a plain
    ``TaskError`` (whose ``str()`` gives the type, message, target and
    hashid) when the type cannot be derived from or is a
    :class:`CallregError` (e.g. an inner Worker's
    :class:`TargetLostError`: then it is the ``__cause__``), and has no
    cause when the exception could not be sent."""

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


class RemoteTraceback(Exception):
    """The ``__cause__`` of a task's exception raised here: its ``str()``
    is the traceback the target formatted (:attr:`TaskError.remote_traceback`),
    so a traceback printed here shows where the task raised."""

    text: str

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _rebuild_error(cls: type[CallregError], message: str, fields: dict[str, Any]) -> CallregError:
    error = Exception.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(fields)
    return error
