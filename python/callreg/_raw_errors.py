"""The exceptions of the extension's errors: a ``RawError``'s field dict
becomes the :class:`CallregError` subclass of its code, and a failed
task's exception is raised as itself (``specs/python.md`` §3, "Task
exceptions")."""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any, NoReturn

from callreg import _callreg
from callreg._codes import CODES
from callreg._errors import (
    CallregError,
    EnvelopeError,
    HandleError,
    LifecycleError,
    RegisterError,
    RemoteTraceback,
    TargetLostError,
    TaskError,
    TaskInputError,
    TaskTimeoutError,
)

if TYPE_CHECKING:
    from callreg._callreg import _ErrorFields

_BY_CODE: dict[str, type[CallregError]] = {
    "HANDLE_FOREIGN": HandleError,
    "HANDLE_STALE": HandleError,
    "HANDLE_MUTATED": HandleError,
    "HANDLE_WRONG_NAMESPACE": HandleError,
    "TARGET_LOST": TargetLostError,
    "NO_LIVE_TARGET": TargetLostError,
    "LIFECYCLE_INVALID": LifecycleError,
    "ENVELOPE_INVALID": EnvelopeError,
    "TASK_FAILED": TaskError,
    "TASK_DEADLINE": TaskTimeoutError,
    "REGISTER_PARTIAL_FAILURE": RegisterError,
    "REGISTER_CLEANUP_UNCERTAIN": RegisterError,
    "REGISTER_POISONED": RegisterError,
    "REGISTER_TOMBSTONE_ACTIVE": RegisterError,
    "UNREGISTER_PARTIAL_FAILURE": RegisterError,
    "UNREGISTER_TOMBSTONE_ACTIVE": RegisterError,
    "LOCAL_SLOT_EXHAUSTED": RegisterError,
}

_TRACEBACK_HEADER = "Traceback (most recent call last):"
# The runtime's kind of a task input it could not unpickle.
_INPUT_INVALID = "TaskInputInvalid"


def error(raw: _callreg.RawError | _ErrorFields) -> BaseException:
    """The exception for a ``RawError`` (or its field dict): a
    :class:`CallregError`, or a failed task's own exception."""
    fields: _ErrorFields = raw.args[0] if isinstance(raw, _callreg.RawError) else raw
    code = fields["code"]
    cls = _BY_CODE.get(code, CallregError)
    common: dict[str, Any] = dict(
        code=code,
        operation=fields["operation"],
        target=fields["target"],
        hashid=fields["hashid"],
        seq=fields["seq"],
    )
    if cls is TaskError:
        return _task_error(fields, common)
    if cls is RegisterError or fields["outcomes"]:
        outcomes = {target: outcome for target, outcome in fields["outcomes"]}
        if cls is CallregError:
            cls = RegisterError
        if cls is RegisterError:
            codes = {target: code for target, code in fields.get("outcome_codes", ())}
            return RegisterError(fields["full"], outcomes=outcomes, outcome_codes=codes, **common)
        if issubclass(cls, TargetLostError):
            return cls(fields["full"], outcomes=outcomes, **common)
        plain = cls(fields["full"], **common)
        plain.outcomes = outcomes  # type: ignore[attr-defined]  # every error with outcomes carries them
        return plain
    return cls(fields["full"], **common)


def raise_error(raw: _callreg.RawError) -> NoReturn:
    """Raises the exception of ``raw`` (from its cause, when it has one)."""
    translated = error(raw)
    raise translated from translated.__cause__


def _task_error(fields: _ErrorFields, common: dict[str, Any]) -> BaseException:
    """The exception of a failed task (``specs/python.md`` §3, "Task
    exceptions"): the exception the task raised, unpickled, of its own
    type and with its own attributes (a ``SystemExit`` too, as
    ``ProcessPoolExecutor`` raises it), with a :class:`RemoteTraceback`
    as ``__cause__`` (the remote traceback, the target, hashid and seq)
    and a note saying where it was raised (Python 3.11 and later); a
    :class:`TaskInputError` when the target could not unpickle the
    task's input; a plain :class:`TaskError` when it did not travel, or
    is a :class:`CallregError` (an inner Worker's, which must not pass
    for this Worker's own; it is the ``TaskError``'s cause)."""
    message = fields["message"]
    cut = message.find("\n" + _TRACEBACK_HEADER)
    short = message[cut + 1 :] if cut >= 0 else None
    text = message[:cut] if cut >= 0 else message
    kind = fields["kind"] or None
    remote: BaseException | None = None
    blob = fields["exception"]
    if blob is not None:
        try:
            loaded = pickle.loads(blob)
        except Exception:
            loaded = None
        if isinstance(loaded, BaseException):
            remote = loaded
    shown = "%s: %s" % (kind, text) if kind else text
    # The traceback as the target printed it, names of by-value code
    # rendered, ending with the exception's own line as Python's do.
    traceback_text = CODES.render(short).rstrip("\n") + "\n" + shown + "\n" if short else None
    if remote is not None:
        carried = remote.__dict__.pop("__callreg_remote__", None) if hasattr(remote, "__dict__") else None
        if isinstance(carried, tuple) and len(carried) == 2 and isinstance(carried[0], str):
            traceback_text = CODES.render(carried[0])
    if kind == _INPUT_INVALID:
        return TaskInputError(
            "the target could not unpickle the task's arguments, so the task did not run: %s (target %s, "
            "hashid %s)" % (text, fields["target"], fields["hashid"]),
            remote_type=kind,
            remote_traceback=traceback_text,
            **common,
        )
    if isinstance(remote, SystemExit) and remote.code is None and remote.args:
        # Rebuilt without its __init__ (tblib's exception pickling, which
        # distributed installs, does so): its code as __init__ sets it.
        remote.code = remote.args[0] if len(remote.args) == 1 else remote.args  # type: ignore[assignment]  # as __init__ sets it
    if remote is not None and not isinstance(remote, CallregError):
        remote.__cause__ = RemoteTraceback(
            traceback_text or shown + "\n",
            target=fields["target"],
            hashid=fields["hashid"],
            seq=fields["seq"],
            remote_type=kind,
        )
        if hasattr(remote, "add_note"):
            remote.add_note("(raised by a callreg task on target %s, hashid %s)" % (fields["target"], fields["hashid"]))
        return remote
    plain_message = "%s (target %s, hashid %s)%s" % (
        shown,
        fields["target"],
        fields["hashid"],
        "\n" + CODES.render(short) if short else "",
    )
    plain = TaskError(plain_message, remote_type=kind, remote_traceback=traceback_text, **common)
    if remote is not None:
        plain.__cause__ = remote
    return plain
