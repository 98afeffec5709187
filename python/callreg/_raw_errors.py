"""The exceptions of the extension's errors: a ``RawError``'s field dict
becomes the :class:`CallregError` subclass of its code, and a failed
task's exception is raised as itself (``specs/python.md`` §3, "Task
exceptions")."""

from __future__ import annotations

import pickle
import threading
import weakref
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


def error(raw: _callreg.RawError | _ErrorFields) -> CallregError:
    """The exception for a ``RawError`` (or its field dict)."""
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
        if issubclass(cls, (RegisterError, TargetLostError)):
            return cls(fields["full"], outcomes=outcomes, **common)
        plain = cls(fields["full"], **common)
        plain.outcomes = outcomes  # type: ignore[attr-defined]  # every error with outcomes carries them
        return plain
    return cls(fields["full"], **common)


def raise_error(raw: _callreg.RawError) -> NoReturn:
    """Raises the exception of ``raw`` (from its cause, when it has one)."""
    translated = error(raw)
    raise translated from translated.__cause__


# Task exception types derived with TaskError, by remote type.
_DUAL_CLASSES: weakref.WeakKeyDictionary[type[BaseException], type[TaskError] | None] = weakref.WeakKeyDictionary()
_DUAL_LOCK = threading.Lock()


def _dual_class(remote: type[BaseException]) -> type[TaskError] | None:
    """A class derived from :class:`TaskError` and ``remote`` (an
    exception type), or ``None`` when ``remote`` cannot be derived from."""
    with _DUAL_LOCK:
        try:
            return _DUAL_CLASSES[remote]
        except KeyError:
            pass
        dual: type[TaskError] | None
        try:
            dual = type(
                remote.__name__,
                (TaskError, remote),
                {
                    "__module__": remote.__module__,
                    "__qualname__": remote.__qualname__,
                    "__str__": remote.__str__,
                    "__repr__": remote.__repr__,
                    "__reduce__": _reduce_remote,
                    "__reduce_ex__": lambda self, protocol: _reduce_remote(self),
                    "__doc__": "%s raised by a task, as a callreg.TaskError." % remote.__qualname__,
                    "_callreg_remote_type": remote,
                },
            )
        except TypeError:  # final type, or instance lay-outs in conflict
            dual = None
        _DUAL_CLASSES[remote] = dual
        return dual


_TASK_FIELDS = ("code", "operation", "target", "hashid", "seq", "remote_type", "remote_traceback")

# Attributes of builtin exceptions kept outside __dict__.
_EXCEPTION_SLOTS = (
    "errno",
    "strerror",
    "filename",
    "filename2",
    "characters_written",
    "msg",
    "lineno",
    "offset",
    "text",
    "end_lineno",
    "end_offset",
    "value",
    "name",
    "path",
    "obj",
)


def _reduce_remote(error: TaskError) -> tuple[Any, ...]:
    """Pickles (and copies) a task's exception as the exception it is an
    instance of, without its TaskError part: what a process that unpickles
    it can rebuild (``copy.copy`` gives that instance too)."""
    state = {k: v for k, v in error.__dict__.items() if k not in _TASK_FIELDS}
    slots = {}
    for name in _EXCEPTION_SLOTS:
        value = getattr(error, name, None)
        if value is not None and name not in state:
            slots[name] = value
    remote_type = vars(type(error))["_callreg_remote_type"]  # set on every derived class
    return (_rebuild_remote, (remote_type, error.args, state, slots))


def _rebuild_remote(
    cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any], slots: dict[str, Any]
) -> BaseException:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    for name, value in slots.items():
        try:
            setattr(error, name, value)
        except (AttributeError, TypeError):
            pass
    return error


def _task_error(fields: _ErrorFields, common: dict[str, Any]) -> TaskError:
    """The exception of a failed task: an instance of both the task's
    exception type and :class:`TaskError` when the exception unpickles
    here (``specs/python.md`` §3, "Task exceptions"), else a plain
    :class:`TaskError`."""
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
    plain_message = "%s (target %s, hashid %s)%s" % (
        shown,
        fields["target"],
        fields["hashid"],
        "\n" + CODES.render(short) if short else "",
    )
    attributes = dict(common, remote_type=kind, remote_traceback=traceback_text)
    dual = None
    if remote is not None and not isinstance(remote, CallregError) and isinstance(remote, Exception):
        dual = _dual_class(type(remote))
    if dual is None:
        plain = TaskError(plain_message, remote_type=kind, remote_traceback=traceback_text, **common)
        if remote is not None:
            plain.__cause__ = remote
        return plain
    assert remote is not None  # a dual class is made for a remote exception only
    rebuilt = _rebuilt_as(dual, remote)
    if rebuilt is None:
        plain = TaskError(plain_message, remote_type=kind, remote_traceback=traceback_text, **common)
        plain.__cause__ = remote
        return plain
    for name in _TASK_FIELDS:
        setattr(rebuilt, name, attributes[name])
    if traceback_text:
        rebuilt.__cause__ = RemoteTraceback(traceback_text)
    return rebuilt


def _rebuilt_as(dual: type[TaskError], remote: BaseException) -> TaskError | None:
    """``remote`` as an instance of ``dual`` (its args, ``__dict__`` and
    builtin slots), built without ``__init__``; ``None`` when that fails."""
    try:
        rebuilt = type(remote).__new__(dual, *remote.args)
        rebuilt.args = remote.args
        rebuilt.__dict__.update(remote.__dict__)
        for name in _EXCEPTION_SLOTS:
            value = getattr(remote, name, None)
            # None is each slot's unset value; setting it would show (an
            # OSError's str() prints a filename2 of None).
            if value is not None and name not in remote.__dict__:
                try:
                    setattr(rebuilt, name, value)
                except (AttributeError, TypeError):
                    pass
    except Exception:
        return None
    return rebuilt
