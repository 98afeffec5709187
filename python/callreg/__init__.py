"""callreg: register Python callables into forked worker processes by
content identity, and run tasks on them as futures.

A :class:`Worker` forks *targets* (child processes) from the calling
interpreter. :meth:`Worker.register` packs a callable with
``cloudpickle.dumps`` into a SPYC envelope, whose hashid (``sha256:...``)
names it everywhere, and installs it in every target; the returned
:class:`Handle` runs tasks with :meth:`Worker.submit` (a
:class:`concurrent.futures.Future`), :meth:`Worker.call`,
:meth:`Worker.call_all` and :meth:`Worker.map`::

    import callreg

    scale = 3
    with callreg.Worker(4) as w:
        w.start()
        h = w.register(lambda x: x * scale)
        print(w.call_all(h, 14))         # {0: 42, 1: 42, 2: 42, 3: 42}
        w.unregister(h)

Process model (Linux):

* :meth:`Worker.start` forks the targets with the interpreter's own fork
  steps, as :func:`os.fork` does (``os.register_at_fork`` hooks run, the
  child's interpreter is valid). Like :func:`os.fork`, it forks even when
  the process runs other threads: only the calling thread exists in a
  target, and a lock another thread held at that moment stays held there
  (an idle extra thread is harmless; CPython itself warns about this
  since 3.12). Any thread may call it: the forks run on a thread the
  Worker owns, so the targets live until the Worker closes (or this
  process dies), whether or not the calling thread ends first.
* A target keeps the interpreter it inherited: the modules imported and
  the globals set before ``start()`` are there. Every callable, whether
  registered before or after ``start()``, is installed in the target from
  its envelope (``cloudpickle.loads``), so both behave the same: a
  callable registered before ``start()`` is not the parent's original
  object, and state it holds is a copy per target.
* Arguments and results travel pickled with cloudpickle both ways (a
  lambda can be an argument or a result). A task's exception is raised
  here as itself: an instance of its own type and of :class:`TaskError`
  (``except ZeroDivisionError`` catches it), with the remote type, the
  full remote traceback and a :class:`RemoteTraceback` as ``__cause__``.
* :class:`Executor` is a :class:`concurrent.futures.Executor` over a
  Worker: ``submit(fn, ...)`` registers ``fn`` once, at its first use.
* A Worker belongs to the process that built it: in a child forked from
  it, it raises :class:`LifecycleError` and closing it does nothing.
* Every wait releases the GIL. Ctrl-C while :meth:`Worker.call` waits
  raises :class:`KeyboardInterrupt` in the caller and leaves the Worker
  usable (the task still finishes in its target; its result is dropped).
* Tasks are sent at submit, so they cannot be cancelled, and have no
  deadline of their own; a task ends when its target answers, is lost
  (e.g. killed: :class:`TargetLostError`) or the Worker closes
  (:class:`LifecycleError`).
* :meth:`Worker.close` (also on leaving a ``with`` block, when the Worker
  is garbage-collected, and at interpreter exit) stops and reaps the
  targets; staged payloads are sealed anonymous memory files that the
  kernel frees with their last descriptor (nothing is ever named in
  ``/dev/shm``).
* Trees: ``Worker(targets, next_level=NextLevel(...), next_level_targets=M)``
  adds M next-level targets (ids after the SUB targets), each running an
  inner Worker of its own; callables registered on the outer Worker run
  there as ``fn(ctx, *args, **kwargs)`` (:class:`Context`). See
  :class:`Worker` and ``specs/python.md`` §5.
* An ``async def`` function is refused by :meth:`Worker.register` (its call
  would only return a coroutine); register a plain function that runs it,
  e.g. ``lambda *a: asyncio.run(coro_fn(*a))``. A generator function's call
  returns a generator, which cannot be pickled: the task fails with
  :class:`TaskError` (``remote_type`` ``"TypeError"``); return a list.
"""

import concurrent.futures
import functools
import inspect as _inspect
import io
import itertools
import json
import linecache
import logging
import os
import pickle
import platform
import re
import sys
import threading
import time
import types
import weakref

import cloudpickle

from callreg import _callreg

_LOGGER = logging.getLogger("callreg")

__all__ = [
    "Executor",
    "Worker",
    "NextLevel",
    "Context",
    "context",
    "Handle",
    "pack",
    "hashid",
    "CallregError",
    "RegisterError",
    "HandleError",
    "TargetLostError",
    "LifecycleError",
    "EnvelopeError",
    "TaskError",
    "RemoteTraceback",
    "DEFAULT_MAX_FRAME_BYTES",
]

__version__ = _callreg.VERSION
"""The package's version (``"MAJOR.MINOR.PATCH"``), as installed."""

DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024
"""The default bound (bytes) on one task's pickled arguments, and on its
pickled result, with a few bytes of framing."""

KIND = "PYTHON_SERIALIZED"
"""The descriptor kind of every handle."""

NAMESPACE = "LOCAL_PYTHON"
"""The target namespace of every handle."""

_PROTOCOL = pickle.HIGHEST_PROTOCOL

# Types whose values pickle to the same bytes with pickle and cloudpickle.
_PLAIN = frozenset((int, float, complex, str, bytes, bool, type(None)))

# --------------------------------------------------------------------------
# Exceptions


class CallregError(Exception):
    """A failed callreg operation.

    ``code`` is the error code (e.g. ``"REGISTER_PARTIAL_FAILURE"``);
    ``operation`` what was being done (``"register"``, ``"task"``, ...);
    ``target`` the target id, ``hashid`` the callable's hashid and ``seq``
    the operation's sequence number, each ``None`` where not applicable.
    ``str()`` is the full message."""

    def __init__(self, message, *, code, operation=None, target=None, hashid=None, seq=None):
        super().__init__(message)
        self.code = code
        self.operation = operation
        self.target = target
        self.hashid = hashid
        self.seq = seq

    def __reduce__(self):
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

    def __init__(self, message, *, outcomes=None, **fields):
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
    did not start, with ``outcomes`` (as :class:`RegisterError`'s; empty
    for a task)."""

    def __init__(self, message, *, outcomes=None, **fields):
        super().__init__(message, **fields)
        self.outcomes = dict(outcomes or {})


class LifecycleError(CallregError):
    """Not allowed in the Worker's state: not started yet, already closed,
    or closed while the task was pending (``code`` ``"LIFECYCLE_INVALID"``)."""


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

    def __init__(self, message, *, remote_type=None, remote_traceback=None, **fields):
        super().__init__(message, **fields)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


def _rebuild_error(cls, message, fields):
    error = Exception.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(fields)
    return error


_BY_CODE = {
    "HANDLE_FOREIGN": HandleError,
    "HANDLE_STALE": HandleError,
    "HANDLE_MUTATED": HandleError,
    "HANDLE_WRONG_NAMESPACE": HandleError,
    "TARGET_LOST": TargetLostError,
    "NO_LIVE_TARGET": TargetLostError,
    "LIFECYCLE_INVALID": LifecycleError,
    "ENVELOPE_INVALID": EnvelopeError,
    "TASK_FAILED": TaskError,
    "REGISTER_PARTIAL_FAILURE": RegisterError,
    "REGISTER_CLEANUP_UNCERTAIN": RegisterError,
    "REGISTER_POISONED": RegisterError,
    "REGISTER_TOMBSTONE_ACTIVE": RegisterError,
    "UNREGISTER_PARTIAL_FAILURE": RegisterError,
    "UNREGISTER_TOMBSTONE_ACTIVE": RegisterError,
    "LOCAL_SLOT_EXHAUSTED": RegisterError,
}

_TRACEBACK_HEADER = "Traceback (most recent call last):"


def _error(raw):
    """The exception for a ``RawError``'s field dict."""
    fields = raw.args[0] if isinstance(raw, _callreg.RawError) else raw
    code = fields["code"]
    cls = _BY_CODE.get(code, CallregError)
    common = dict(
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
        error = cls(fields["full"], **common)
        error.outcomes = outcomes
        return error
    return cls(fields["full"], **common)


class RemoteTraceback(Exception):
    """The ``__cause__`` of a task's exception raised here: its ``str()``
    is the traceback the target formatted (:attr:`TaskError.remote_traceback`),
    so a traceback printed here shows where the task raised."""

    def __init__(self, text):
        super().__init__(text)
        self.text = text

    def __str__(self):
        return self.text


# Task exception types derived with TaskError, by remote type.
_DUAL_CLASSES = weakref.WeakKeyDictionary()
_DUAL_LOCK = threading.Lock()


def _dual_class(remote):
    """A class derived from :class:`TaskError` and ``remote`` (an
    exception type), or ``None`` when ``remote`` cannot be derived from."""
    with _DUAL_LOCK:
        try:
            return _DUAL_CLASSES[remote]
        except KeyError:
            pass
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


def _reduce_remote(error):
    """Pickles (and copies) a task's exception as the exception it is an
    instance of, without its TaskError part: what a process that unpickles
    it can rebuild (``copy.copy`` gives that instance too)."""
    state = {k: v for k, v in error.__dict__.items() if k not in _TASK_FIELDS}
    slots = {}
    for name in _EXCEPTION_SLOTS:
        value = getattr(error, name, None)
        if value is not None and name not in state:
            slots[name] = value
    return (_rebuild_remote, (type(error)._callreg_remote_type, error.args, state, slots))


def _rebuild_remote(cls, args, state, slots):
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    for name, value in slots.items():
        try:
            setattr(error, name, value)
        except (AttributeError, TypeError):
            pass
    return error


def _task_error(fields, common):
    """The exception of a failed task: an instance of both the task's
    exception type and :class:`TaskError` when the exception unpickles
    here (``specs/python.md`` §3, "Task exceptions"), else a plain
    :class:`TaskError`."""
    message = fields["message"]
    cut = message.find("\n" + _TRACEBACK_HEADER)
    short = message[cut + 1 :] if cut >= 0 else None
    text = message[:cut] if cut >= 0 else message
    kind = fields["kind"] or None
    remote = None
    blob = fields["exception"]
    if blob is not None:
        try:
            remote = pickle.loads(blob)
        except Exception:
            remote = None
        if not isinstance(remote, BaseException):
            remote = None
    traceback_text = short
    if remote is not None:
        carried = remote.__dict__.pop("__callreg_remote__", None) if hasattr(remote, "__dict__") else None
        if isinstance(carried, tuple) and len(carried) == 2 and isinstance(carried[0], str):
            traceback_text = _CODES.render(carried[0])
    shown = "%s: %s" % (kind, text) if kind else text
    plain_message = "%s (target %s, hashid %s)%s" % (
        shown,
        fields["target"],
        fields["hashid"],
        "\n" + _CODES.render(short) if short else "",
    )
    attributes = dict(common, remote_type=kind, remote_traceback=traceback_text)
    dual = None
    if remote is not None and not isinstance(remote, CallregError) and isinstance(remote, Exception):
        dual = _dual_class(type(remote))
    if dual is None:
        error = TaskError(plain_message, remote_type=kind, remote_traceback=traceback_text, **common)
        if remote is not None:
            error.__cause__ = remote
        return error
    error = _rebuilt_as(dual, remote)
    if error is None:
        error = TaskError(plain_message, remote_type=kind, remote_traceback=traceback_text, **common)
        error.__cause__ = remote
        return error
    for name in _TASK_FIELDS:
        setattr(error, name, attributes[name])
    if traceback_text:
        error.__cause__ = RemoteTraceback(traceback_text)
    return error


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


def _rebuilt_as(dual, remote):
    """``remote`` as an instance of ``dual`` (its args, ``__dict__`` and
    builtin slots), built without ``__init__``; ``None`` when that fails."""
    try:
        error = type(remote).__new__(dual, *remote.args)
        error.args = remote.args
        error.__dict__.update(remote.__dict__)
        for name in _EXCEPTION_SLOTS:
            value = getattr(remote, name, None)
            # None is each slot's unset value; setting it would show (an
            # OSError's str() prints a filename2 of None).
            if value is not None and name not in remote.__dict__:
                try:
                    setattr(error, name, value)
                except (AttributeError, TypeError):
                    pass
    except Exception:
        return None
    return error


class _CodeRegistry:
    """Where the code of registered callables was defined: the parent
    records the code objects of each callable it packs (and of the
    functions it refers to by global name, pickled with it), so that a
    target's traceback frames of code pickled by value (file
    ``<dynamic-code>`` with cloudpickle 3.1 and later) name their file
    and show their source line as this process reads them."""

    def __init__(self):
        self.lock = threading.Lock()
        # function name -> [(first line, last line, file)]
        self.spans = {}

    def record(self, fn):
        seen = set()
        stack = [fn]
        budget = 256
        while stack and budget:
            budget -= 1
            obj = stack.pop()
            code = getattr(obj, "__code__", None)
            if code is None:
                func = getattr(obj, "func", None) or getattr(obj, "__func__", None)  # partial, method
                if func is not None:
                    stack.append(func)
                continue
            if id(code) in seen:
                continue
            seen.add(id(code))
            self._record_code(code, seen)
            names = getattr(obj, "__globals__", {})
            referred = [names.get(name) for name in code.co_names]
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    referred.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            for value in referred:
                if callable(value) and hasattr(value, "__code__"):
                    stack.append(value)

    def _record_code(self, code, seen):
        codes = [code]
        while codes:
            code = codes.pop()
            lines = [line for _, _, line in code.co_lines() if line is not None]
            if lines and not code.co_filename.startswith("<"):
                span = (min(lines + [code.co_firstlineno]), max(lines), code.co_filename)
                with self.lock:
                    spans = self.spans.setdefault(code.co_name, [])
                    if span not in spans:
                        spans.append(span)
                        del spans[:-8]
            for const in code.co_consts:
                if hasattr(const, "co_lines") and id(const) not in seen:
                    seen.add(id(const))
                    codes.append(const)

    def file_of(self, name, line):
        with self.lock:
            spans = list(self.spans.get(name, ()))
        found = [path for first, last, path in spans if first <= line <= last]
        return found[0] if len(set(found)) == 1 else None

    def render(self, text):
        """``text`` (a formatted traceback) with each ``<dynamic-code>``
        frame of a recorded callable given its file and source line."""
        if '"<dynamic-code>"' not in text:
            return text
        out = []
        for line in text.splitlines(keepends=True):
            match = _DYNAMIC_FRAME.match(line)
            if match is not None:
                number, name = int(match.group(1)), match.group(2)
                path = self.file_of(name, number)
                if path is not None:
                    out.append('  File "%s", line %d, in %s\n' % (path, number, name))
                    source = linecache.getline(path, number).strip()
                    if source:
                        out.append("    %s\n" % source)
                    continue
            out.append(line)
        return "".join(out)


_DYNAMIC_FRAME = re.compile(r'^  File "<dynamic-code>", line (\d+), in (.+)$')
_CODES = _CodeRegistry()


def _raise(raw):
    error = _error(raw)
    raise error from error.__cause__


# --------------------------------------------------------------------------
# Envelopes and hashids


_HEADER_LEN = 16


def pack(fn):
    """The SPYC envelope (bytes) of ``cloudpickle.dumps(fn)``: a 16-byte
    header then the payload. The payload is pickled straight into the
    envelope's buffer (one copy of it in all: what ``cloudpickle.dumps``
    alone costs). Raises what cloudpickle raises for an object it cannot
    pickle."""
    return _pack(fn, cloudpickle.Pickler)


class _InheritingPickler(cloudpickle.Pickler):
    """cloudpickle's pickler, except that the objects of ``inherited``
    (functions and classes of ``__main__`` that existed when the targets
    were forked, so that every target's ``__main__`` has them) are pickled
    by name, as ``pickle`` and ``ProcessPoolExecutor`` do, instead of by
    value with a copy of their globals: they then see the target's module
    globals (what an initializer set there)."""

    inherited = {}

    def reducer_override(self, obj):
        if self.inherited.get(id(obj)) is obj:
            return NotImplemented
        return super().reducer_override(obj)


def _main_objects():
    """{id: object} of the functions and classes of ``__main__`` now."""
    main = sys.modules.get("__main__")
    found = {}
    for value in list(vars(main).values()) if main is not None else ():
        if _inspect.isfunction(value) or isinstance(value, type):
            if getattr(value, "__module__", None) == "__main__":
                found[id(value)] = value
    return found


def _pack(fn, pickler):
    buffer = io.BytesIO()
    buffer.write(bytes(_HEADER_LEN))
    pickler(buffer, protocol=_PROTOCOL).dump(fn)
    size = buffer.tell() - _HEADER_LEN
    buffer.seek(0)
    buffer.write(_callreg.envelope_header(size))
    # The buffer's own bytes, not a copy (nothing else refers to it).
    return buffer.getvalue()


def hashid(obj):
    """The hashid (``"sha256:"`` + 64 hex digits) of envelope bytes, of a
    :class:`Handle`, or of a callable (via :func:`pack`; two packs of one
    function give one hashid). Raises :class:`EnvelopeError` for bytes that
    are not an envelope, ``TypeError`` for anything else."""
    if isinstance(obj, Handle):
        return obj.hashid
    if isinstance(obj, (bytes, bytearray, memoryview)):
        try:
            return _callreg.envelope_hashid(bytes(obj))
        except _callreg.RawError as raw:
            _raise(raw)
    if callable(obj):
        return _callreg.envelope_hashid(pack(obj))
    raise TypeError("hashid() takes envelope bytes, a Handle or a callable, not %s" % type(obj).__name__)


def _default_metadata(name):
    return {
        "name": name,
        "python": {
            "version": platform.python_version(),
            "serializer": "cloudpickle",
            "serializer_version": cloudpickle.__version__,
        },
    }


def _hook_list(hooks, key):
    if not isinstance(hooks, (list, tuple)):
        raise TypeError("metadata[%r] must be a list of hook calls" % key)
    out = []
    for hook in hooks:
        if isinstance(hook, dict) and isinstance(hook.get("hashid"), Handle):
            hook = dict(hook, hashid=hook["hashid"].hashid)
        out.append(hook)
    return out


def _merge_metadata(base, metadata):
    if metadata is None:
        return base
    if not isinstance(metadata, dict):
        raise TypeError("metadata must be a dict, not %s" % type(metadata).__name__)
    merged = dict(base or {})
    for key, value in metadata.items():
        if key in ("call_before", "call_after"):
            value = _hook_list(value, key)
        merged[key] = value
    return merged


def _dumps_input(obj, values):
    """A task input ``obj`` pickled: with ``pickle`` when every one of its
    ``values`` is of a plain type (the bytes cloudpickle would give, for
    about a fifth of its cost), else with cloudpickle."""
    for value in values:
        if type(value) not in _PLAIN:
            return cloudpickle.dumps(obj, protocol=_PROTOCOL)
    return pickle.dumps(obj, protocol=_PROTOCOL)


def _check_registrable(fn, verb):
    """``TypeError`` unless ``fn`` is a callable whose call returns its
    result (not an ``async def`` function's coroutine)."""
    if not callable(fn):
        raise TypeError("%s() takes a callable, not %s" % (verb, type(fn).__name__))
    if _inspect.iscoroutinefunction(fn) or _inspect.isasyncgenfunction(fn):
        raise TypeError(
            "%s is an async function: its call would return a coroutine, which a target "
            "cannot send back; %s a function that runs it (e.g. with asyncio.run)" % (_callable_name(fn), verb)
        )


def _metadata_json(meta):
    """``meta`` as compact JSON; raises :class:`CallregError`
    (``METADATA_INVALID``) naming why it is not JSON (a NaN or infinite
    number, a value JSON has no form for, nesting too deep)."""
    try:
        return json.dumps(meta, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        reason = "it nests too deeply" if isinstance(error, RecursionError) else str(error)
        raise CallregError(
            "METADATA_INVALID: the metadata is not JSON: %s (operation register)" % reason,
            code="METADATA_INVALID",
            operation="register",
        ) from None


def _callable_name(fn):
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name:
        func = getattr(fn, "func", None)  # functools.partial
        name = getattr(func, "__qualname__", None) or type(fn).__qualname__
    return name


# --------------------------------------------------------------------------
# Handles


class Handle:
    """A registration, returned by :meth:`Worker.register`: immutable,
    hashable, equal only to itself (two registers of one function give two
    unequal handles with one hashid). It cannot be pickled or built by hand;
    another Worker refuses it (:class:`HandleError`, ``HANDLE_FOREIGN``), and
    so does its own after :meth:`Worker.unregister` (``HANDLE_STALE``)."""

    __slots__ = ("_raw", "__weakref__")

    # Handle[P, R] in annotations (the stubs make it generic in the
    # callable's parameters and result).
    __class_getitem__ = classmethod(types.GenericAlias)

    def __init__(self, *args, **kwargs):
        raise TypeError("a Handle is returned by Worker.register, not built directly")

    @classmethod
    def _of(cls, raw):
        handle = object.__new__(cls)
        object.__setattr__(handle, "_raw", raw)
        return handle

    def __setattr__(self, name, value):
        raise AttributeError("a Handle is immutable")

    def __delattr__(self, name):
        raise AttributeError("a Handle is immutable")

    def __reduce__(self):
        raise TypeError("a Handle cannot be pickled: it is valid only in the Worker that issued it")

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    @property
    def hashid(self):
        """The callable's hashid, ``"sha256:"`` + 64 lowercase hex digits."""
        return self._raw.hashid

    @property
    def digest(self):
        """The hashid's 32 bytes."""
        return self._raw.digest

    @property
    def kind(self):
        """``"PYTHON_SERIALIZED"``."""
        return KIND

    @property
    def namespace(self):
        """``"LOCAL_PYTHON"``."""
        return self._raw.namespace

    def __repr__(self):
        return "<callreg.Handle %s #%d %s>" % (self.hashid, self._raw.handle_id, self.namespace)


def _raw_handle(handle):
    if not isinstance(handle, Handle):
        raise HandleError(
            "%r is not a Handle returned by Worker.register" % (handle,),
            code="HANDLE_FOREIGN",
            operation="resolve",
        )
    return handle._raw


# --------------------------------------------------------------------------
# Next-level targets


class NextLevel:
    """What each next-level target of a :class:`Worker` builds: an inner
    :class:`Worker` of ``targets`` SUB targets (``None``: one per CPU) and,
    when ``next_level`` is another :class:`NextLevel`, ``next_level_targets``
    next-level targets of its own (a tree of any depth). ``setup(inner)``
    runs in the next-level child before the inner Worker starts (what it
    registers joins the inner startup snapshot) and returns a dict of
    handles (``None`` for none), given to orchestration callables as
    ``ctx.handles``. ``control_timeout``, ``operation_timeout``,
    ``slot_capacity``, ``max_frame_bytes``, ``probe_first``,
    ``respawn_limit`` and ``respawn_backoff`` are the inner Worker's, as in
    :class:`Worker`.

    The objects are inherited by ``fork``, not pickled: ``setup`` may be any
    callable, a lambda or a closure included."""

    __slots__ = (
        "targets",
        "setup",
        "next_level",
        "next_level_targets",
        "control_timeout",
        "operation_timeout",
        "slot_capacity",
        "max_frame_bytes",
        "probe_first",
        "respawn_limit",
        "respawn_backoff",
    )

    def __init__(
        self,
        targets=None,
        *,
        setup=None,
        next_level=None,
        next_level_targets=None,
        control_timeout=30.0,
        slot_capacity=64,
        max_frame_bytes=DEFAULT_MAX_FRAME_BYTES,
        operation_timeout=None,
        probe_first=True,
        respawn_limit=3,
        respawn_backoff=0.1,
    ):
        if setup is not None and not callable(setup):
            raise TypeError("setup must be a callable or None, not %s" % type(setup).__name__)
        _counts(targets, next_level, next_level_targets)
        _check_options(control_timeout, slot_capacity, max_frame_bytes, operation_timeout)
        _check_respawn(probe_first, respawn_limit, respawn_backoff)
        self.probe_first = probe_first
        self.respawn_limit = respawn_limit
        self.respawn_backoff = respawn_backoff
        self.targets = targets
        self.setup = setup
        self.next_level = next_level
        self.next_level_targets = next_level_targets
        self.control_timeout = control_timeout
        self.operation_timeout = operation_timeout
        self.slot_capacity = slot_capacity
        self.max_frame_bytes = max_frame_bytes

    def __repr__(self):
        return "<callreg.NextLevel targets=%r next_level_targets=%r next_level=%r>" % (
            self.targets,
            self.next_level_targets,
            self.next_level,
        )


class Context:
    """The first argument of every callable run on a next-level target:
    ``inner`` is the next-level child's own :class:`Worker` (started),
    ``handles`` the dict ``setup`` returned, ``target`` this target's id
    in the outer Worker. :func:`context` returns it anywhere in that
    child."""

    __slots__ = ("inner", "handles", "target")

    def __init__(self, inner, handles, target):
        self.inner = inner
        self.handles = handles
        self.target = target

    def close(self):
        """Closes the inner Worker (when the next-level target stops)."""
        self.inner.close()

    def __reduce__(self):
        raise TypeError("a callreg.Context lives in its next-level target and cannot be pickled")

    def __repr__(self):
        return "<callreg.Context of target %d, inner %r, handles %s>" % (
            self.target,
            self.inner,
            sorted(self.handles),
        )


_CONTEXT = None


def context():
    """The :class:`Context` of this process when it is a next-level target,
    else ``None`` (in a parent, in a SUB target, after any fork)."""
    return _CONTEXT


def _forget_context():
    global _CONTEXT
    _CONTEXT = None


# A context (its inner Worker) belongs to the process that built it.
os.register_at_fork(after_in_child=_forget_context)


def _initialize_target(initializer, initargs, sub_targets, level, target):
    """The target initializer of a Worker (run by the runtime in each of
    its targets and replacements, at their start, before they serve):
    ``initializer(*initargs)``, then, with next-level targets,
    :func:`_start_target`. An exception from ``initializer`` is printed to
    the target's stderr and raised (the target is then lost at start)."""
    if initializer is not None:
        try:
            initializer(*initargs)
        except BaseException:
            import traceback

            traceback.print_exc()
            raise
    if level is None:
        return None
    return _start_target(sub_targets, level, target)


def _start_target(sub_targets, level, target):
    """The target initializer of a Worker with next-level targets (run by
    the runtime in each of its targets, at start, on the target's main
    thread): ``None`` on a SUB target; on a next-level target, builds the
    inner Worker, runs ``setup``, starts it and returns the
    :class:`Context`. A failure (``setup`` raising, or a registration of
    ``setup`` failing in the inner targets) is printed to this target's
    stderr and raised (the target is then lost at start)."""
    global _CONTEXT
    if target < sub_targets:
        return None
    inner = None
    try:
        inner = Worker(
            level.targets,
            next_level=level.next_level,
            next_level_targets=level.next_level_targets,
            control_timeout=level.control_timeout,
            operation_timeout=level.operation_timeout,
            slot_capacity=level.slot_capacity,
            max_frame_bytes=level.max_frame_bytes,
            probe_first=level.probe_first,
            respawn_limit=level.respawn_limit,
            respawn_backoff=level.respawn_backoff,
        )
        handles = level.setup(inner) if level.setup is not None else None
        if handles is None:
            handles = {}
        if not isinstance(handles, dict):
            raise TypeError("setup must return a dict of handles or None, not %s" % type(handles).__name__)
        failed = inner.start()
        if failed:
            # A callable setup registered did not install in the inner
            # targets: this next-level target cannot serve as set up.
            raise next(iter(failed.values()))
    except BaseException:
        import traceback

        traceback.print_exc()
        if inner is not None:
            inner.close()
        raise
    _CONTEXT = Context(inner, handles, target)
    return _CONTEXT


def _counts(targets, next_level, next_level_targets):
    """Checks a Worker's (or NextLevel's) target counts; returns (SUB
    targets, next-level targets)."""
    if next_level is not None and not isinstance(next_level, NextLevel):
        raise TypeError("next_level must be a callreg.NextLevel or None, not %s" % type(next_level).__name__)
    if targets is None:
        targets = os.cpu_count() or 1
    if next_level is None:
        if next_level_targets is not None:
            raise ValueError("next_level_targets needs next_level")
        return _positive_int("targets", targets, 0xFFFF), 0
    if next_level_targets is None:
        next_level_targets = 1
    _positive_int("next_level_targets", next_level_targets, 0xFFFF)
    if isinstance(targets, bool) or not isinstance(targets, int):
        raise TypeError("targets must be an int, not %s" % type(targets).__name__)
    if not 0 <= targets <= 0xFFFF - next_level_targets:
        raise ValueError(
            "targets must be between 0 and %d with %d next-level targets, got %d"
            % (0xFFFF - next_level_targets, next_level_targets, targets)
        )
    return targets, next_level_targets


def _check_options(control_timeout, slot_capacity, max_frame_bytes, operation_timeout=None):
    _positive_int("slot_capacity", slot_capacity, 0xFFFF)
    _positive_int("max_frame_bytes", max_frame_bytes, 0xFFFFFFFF)
    _seconds("control_timeout", control_timeout)
    if operation_timeout is not None:
        _seconds("operation_timeout", operation_timeout)


# The longest time a Worker's option may name (about 31 years).
_MAX_SECONDS = 10**9


def _check_respawn(probe_first, respawn_limit, respawn_backoff):
    if not isinstance(probe_first, bool):
        raise TypeError("probe_first must be True or False, not %s" % type(probe_first).__name__)
    if isinstance(respawn_limit, bool) or not isinstance(respawn_limit, int):
        raise TypeError("respawn_limit must be an int, not %s" % type(respawn_limit).__name__)
    if not 0 <= respawn_limit <= 0xFFFF:
        raise ValueError("respawn_limit must be between 0 and 65535, got %d" % respawn_limit)
    if isinstance(respawn_backoff, bool) or not isinstance(respawn_backoff, (int, float)):
        raise TypeError("respawn_backoff must be a number of seconds, not %s" % type(respawn_backoff).__name__)
    if not 0 <= respawn_backoff < float("inf"):
        raise ValueError("respawn_backoff must be zero or positive, got %r" % (respawn_backoff,))
    if respawn_backoff > _MAX_SECONDS:
        raise ValueError("respawn_backoff must be at most %d seconds, got %r" % (_MAX_SECONDS, respawn_backoff))


def _seconds(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("%s must be a number of seconds, not %s" % (name, type(value).__name__))
    if not 0 < value < float("inf"):
        raise ValueError("%s must be positive, got %r" % (name, value))
    if value > _MAX_SECONDS:
        raise ValueError("%s must be at most %d seconds, got %r" % (name, _MAX_SECONDS, value))


# --------------------------------------------------------------------------
# The Worker


def _resolve(resolve, value):
    """Resolves a future in the dispatcher thread. ``concurrent.futures``
    logs an ``Exception`` raised by a done-callback; a ``BaseException``
    (``SystemExit``, ``KeyboardInterrupt``) would end the dispatcher and
    strand every later future, so it is reported the same way and the
    dispatcher goes on."""
    try:
        resolve(value)
    except BaseException:  # a done-callback's SystemExit or KeyboardInterrupt
        _LOGGER.exception("a done-callback of a callreg future raised")


class _Dispatch:
    """Armed futures waiting for results (:meth:`_TaskFuture._arm`), and
    the thread that resolves them. Holds no reference to its Worker (so the
    Worker can be garbage-collected)."""

    def __init__(self, raw):
        self.raw = raw
        self.lock = threading.Lock()
        self.futures = {}
        self.thread = None
        self.closed = False

    def start(self):
        """Starts the thread once (at the first arm)."""
        with self.lock:
            if self.thread is None and not self.closed:
                self.thread = threading.Thread(target=self.run, name="callreg-dispatch", daemon=True)
                self.thread.start()

    def run(self):
        while self.serve(0.5):
            pass
        self.fail_remaining()

    def serve(self, timeout):
        """Resolves the futures of the completions there within
        ``timeout`` seconds; ``False`` once the Worker closed and every
        completion was served."""
        batch = self.raw.next_completions(timeout)
        if batch is None:
            return False
        for task, output, error in batch:
            with self.lock:
                future = self.futures.pop(task, None)
            if future is not None:
                future._resolve(output, error)
        return True

    def serve_until(self, future, timeout):
        """On the dispatcher thread (a done-callback waiting on another
        armed future): serves completions until ``future`` is done or
        ``timeout`` seconds passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not future.done():
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left < 0 or not self.serve(left):
                return

    def fail_remaining(self):
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


class _ArmingList(list):
    """A future's waiter list (``concurrent.futures.wait`` and
    ``as_completed`` append to it): a waiter added arms the future, whose
    result must then arrive without an inline wait."""

    __slots__ = ("future",)

    def append(self, waiter):
        super().append(waiter)
        future = self.future()  # a weak reference: no cycle to collect
        if future is not None:
            future._arm()


# RawPending.wait's answers besides a result: 0, another thread holds
# the task (or it was armed); 1, the time was up.
_PENDING_TIMED_OUT = 1
# How long a waiter sleeps while another thread holds the pending task
# (seconds), before it looks again.
_HELD_SLICE = 0.005


class _TaskFuture(concurrent.futures.Future):
    """The :class:`concurrent.futures.Future` of a task (running from its
    submit). Its first waiter (:meth:`result`, :meth:`exception`) waits for
    the result inline, reading the targets' replies itself, with no other
    thread woken (a second concurrent waiter sleeps in short slices until
    the first resolves it or gives the task back, and looks again); a
    done-callback, a ``concurrent.futures.wait`` or ``as_completed`` on it
    hands it to the Worker's dispatcher thread instead. ``done()`` reads a
    result already there without waiting."""

    def __init__(self, pending, dispatch):
        super().__init__()
        self._state = concurrent.futures._base.RUNNING
        waiters = _ArmingList()
        waiters.future = weakref.ref(self)
        self._waiters = waiters
        self._pending = pending
        self._dispatch = dispatch

    def _resolve(self, output, error):
        """Sets the result (``output``: pickled bytes) or the error (a
        ``RawError`` field dict); done-callbacks run in this thread."""
        self._pending = None
        if error is None:
            try:
                value = pickle.loads(output)
            except BaseException as exc:  # an unpicklable result
                _resolve(self.set_exception, exc)
            else:
                _resolve(self.set_result, value)
        else:
            _resolve(self.set_exception, _error(error))

    def _arm(self):
        """Hands the result to the dispatcher thread (once; a no-op when
        another thread waits inline or it is done)."""
        pending = self._pending
        if pending is None:
            return
        dispatch = self._dispatch
        # Under the lock the dispatcher pops under: a result sent at once
        # finds the future there.
        with dispatch.lock:
            armed = dispatch.raw.arm(pending)
            if armed:
                dispatch.futures[pending.id] = self
        if armed:
            self._pending = None
            dispatch.start()
            return
        # Another thread waits inline (it resolves), or the Worker closed
        # (the result, LIFECYCLE_INVALID, is there at once).
        outcome = pending.wait(0)
        if isinstance(outcome, tuple):
            self._resolve(*outcome)

    def _wait_inline(self, deadline):
        """Waits until the result is there or ``deadline`` (a
        ``time.monotonic()`` instant, ``None``: no limit) passes: in this
        thread, reading the targets' replies, when no other thread holds
        the pending task; while another does (its own wait, or a look),
        in short slices until it resolves the future or gives the task
        back. On the dispatcher thread itself (a done-callback waiting on
        an armed future) it resolves completions until this one is done."""
        running = concurrent.futures._base.RUNNING
        while self._state == running:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            pending = self._pending
            if pending is None:  # armed: the dispatcher resolves it
                if self._dispatch.thread is threading.current_thread():
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
                if self._state == running:
                    self._condition.wait(_HELD_SLICE if left is None else min(_HELD_SLICE, left))
            if deadline is not None and time.monotonic() >= deadline:
                return

    def result(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wait_inline(deadline)
        return super().result(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def exception(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wait_inline(deadline)
        return super().exception(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def add_done_callback(self, fn):
        super().add_done_callback(fn)
        self._arm()

    def done(self):
        # A look without waiting: reads a reply already there (no other
        # thread may be reading the targets' replies for it).
        pending = self._pending
        if pending is not None and self._state == concurrent.futures._base.RUNNING:
            outcome = pending.wait(0)
            if isinstance(outcome, tuple):
                self._resolve(*outcome)
        return super().done()

    def running(self):
        return not self.done() and super().running()

    def __repr__(self):
        self.done()
        return super().__repr__()


def _shutdown(raw, dispatch):
    """Closes a Worker: at :meth:`Worker.close`, garbage collection or exit."""
    with dispatch.lock:
        dispatch.closed = True
    raw.close()
    thread = dispatch.thread
    if thread is not None and thread is not threading.current_thread():
        thread.join()
    dispatch.fail_remaining()


def _positive_int(name, value, limit):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("%s must be an int, not %s" % (name, type(value).__name__))
    if not 1 <= value <= limit:
        raise ValueError("%s must be between 1 and %d, got %d" % (name, limit, value))
    return value


class Worker:
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
    replacements of one slot in a row may be lost before they join (a
    callable that kills every new process); after that the slot stays lost
    and :meth:`slot_events` says so. ``respawn_backoff`` (seconds, default
    0.1) is the wait before the second replacement in a row, doubling for
    each further one; the first comes at once.
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

    Thread-safe: any number of threads may submit at once. A context
    manager: leaving a ``with`` block closes it."""

    def __init__(
        self,
        targets=None,
        *,
        next_level=None,
        next_level_targets=None,
        control_timeout=30.0,
        slot_capacity=64,
        max_frame_bytes=DEFAULT_MAX_FRAME_BYTES,
        operation_timeout=None,
        probe_first=True,
        respawn_limit=3,
        respawn_backoff=0.1,
        initializer=None,
        initargs=(),
    ):
        sub, upper = _counts(targets, next_level, next_level_targets)
        _check_respawn(probe_first, respawn_limit, respawn_backoff)
        _check_options(control_timeout, slot_capacity, max_frame_bytes, operation_timeout)
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable or None, not %s" % type(initializer).__name__)
        initargs = tuple(initargs)
        if initializer is None and next_level is None:
            target_initializer = None
        else:
            target_initializer = functools.partial(_initialize_target, initializer, initargs, sub, next_level)
        try:
            self._raw = _callreg.RawWorker(
                sub + upper,
                float(control_timeout),
                slot_capacity,
                max_frame_bytes,
                target_initializer,
                None if operation_timeout is None else float(operation_timeout),
                probe_first,
                respawn_limit,
                float(respawn_backoff),
            )
        except _callreg.RawError as raw:
            _raise(raw)
        self._count = sub + upper
        self._slot_capacity = slot_capacity
        self._control_timeout = float(control_timeout)
        self._sub = sub
        # Handles registered before start (None once started).
        self._prestart = []
        self._dispatch = _Dispatch(self._raw)
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._raw, self._dispatch)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        state = "closed" if self._closed else "targets %s" % (self.targets,)
        return "<callreg.Worker of %d targets, %s>" % (self._count, state)

    # -- registration --------------------------------------------------

    def register(self, fn, *, metadata=None):
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

        Raises ``TypeError`` for a non-callable or an ``async def``
        function, :class:`RegisterError` (``.outcomes`` per target) when a
        target failed to install it (rolled back), :class:`CallregError`
        (``METADATA_INVALID``) for bad metadata or (``METADATA_CONFLICT``)
        for other metadata than it is registered with,
        :class:`LifecycleError` once closed."""
        _check_registrable(fn, "register")
        envelope = pack(fn)
        meta = _merge_metadata(_default_metadata(_callable_name(fn)), metadata)
        handle = self._register(envelope, meta)
        _CODES.record(fn)
        return handle

    def register_envelope(self, data, *, metadata=None):
        """Registers a pre-packed SPYC envelope (e.g. from ``callreg pack``
        or :func:`pack`) with ``metadata`` (a dict, or ``None`` for none:
        nothing is filled in, the packer's versions are unknown here).

        Raises ``TypeError`` unless ``data`` is bytes-like,
        :class:`EnvelopeError` for invalid bytes, then as :meth:`register`."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError("register_envelope() takes bytes, not %s" % type(data).__name__)
        meta = _merge_metadata(None, metadata) if metadata is not None else None
        return self._register(bytes(data), meta)

    def _register(self, envelope, meta):
        text = None if meta is None else _metadata_json(meta)
        try:
            raw = self._raw.register(envelope, text)
        except _callreg.RawError as error:
            _raise(error)
        handle = Handle._of(raw)
        if self._prestart is not None:
            # Before start: start() maps failed snapshot entries back to it.
            self._prestart.append(handle)
        return handle

    def unregister(self, handle):
        """Unregisters ``handle``; returns once every target dropped it.
        Raises :class:`HandleError` for a foreign or stale handle,
        :class:`RegisterError` when a target failed to drop it."""
        raw = _raw_handle(handle)
        try:
            self._raw.unregister(raw)
        except _callreg.RawError as error:
            _raise(error)

    def forgive(self, callable_or_hashid):
        """Clears the poison of a callable (its hashid, a :class:`Handle`,
        envelope bytes or the callable itself): its next :meth:`register`
        tries it again on one target (``specs/protocol.md`` §2.8). A
        callable is poisoned when the target that tried it first died
        while installing it, or was still busy with it at the operation
        bound; forgive it when that was not its fault (an external kill,
        memory pressure). Returns whether it was poisoned. Raises
        ``ValueError`` for a string that is not a hashid."""
        if isinstance(callable_or_hashid, str):
            name = callable_or_hashid
        else:
            name = hashid(callable_or_hashid)
        return self._raw.forgive(name)

    # -- lifecycle -----------------------------------------------------

    def start(self):
        """Forks the targets from this interpreter (see the module docs) and
        waits until each installed the startup snapshot.

        Returns the pre-start registrations that failed, as a dict
        ``{Handle: RegisterError}`` (empty when every one was installed): a
        callable of the startup snapshot that some target could not install
        (it failed to unpickle, or its version or dependency check refused
        it) fails its registration only. Its handle is no longer live
        (:class:`HandleError`, ``HANDLE_STALE``), every target that did
        install it drops it, the error's ``outcomes`` give each failing
        target's reason (code, Python type and message), and the Worker
        starts with the rest.

        Raises :class:`LifecycleError` unless new, :class:`RegisterError`
        or :class:`TargetLostError` when a target did not start (the Worker
        then serves with the others)."""
        prestart, self._prestart = self._prestart, None
        try:
            failed = self._raw.start()
        except _callreg.RawError as error:
            _raise(error)
        by_id = {h._raw.handle_id: h for h in prestart or ()}
        return {by_id[handle_id]: _error(fields) for handle_id, fields in failed if handle_id in by_id}

    def close(self):
        """Closes the Worker: pending futures fail with
        :class:`LifecycleError`, targets are stopped and reaped, staged
        payloads are removed. Idempotent."""
        self._closed = True
        self._finalizer()

    # -- tasks ---------------------------------------------------------

    @staticmethod
    def _input(args, kwargs):
        return _dumps_input((args, kwargs), itertools.chain(args, kwargs.values()))

    def _target(self, target):
        if target is None:
            return None
        if isinstance(target, bool) or not isinstance(target, int):
            raise TypeError("target must be an int or None, not %s" % type(target).__name__)
        if not 0 <= target < self._count:
            raise ValueError(
                "target must be in 0..%d (the Worker's %d target ids), got %d" % (self._count - 1, self._count, target)
            )
        return target

    def submit(self, handle, /, *args, target=None, **kwargs):
        """Runs ``handle(*args, **kwargs)`` on ``target`` (any live target
        when ``None``, in turn) and returns a
        :class:`concurrent.futures.Future` of its result (running at once;
        it cannot be cancelled). The future fails with :class:`TaskError`,
        :class:`TargetLostError`, :class:`HandleError` or
        :class:`LifecycleError`.

        The first thread that waits on the future (``result()``,
        ``exception()``) reads the result itself, as :meth:`call` does;
        done-callbacks run in the thread that resolves the future (that
        waiter, or the Worker's dispatcher thread for a future with
        done-callbacks or in ``concurrent.futures.wait`` that nobody waits
        on)."""
        if not isinstance(handle, Handle) and callable(handle):
            raise HandleError(
                "submit() takes a Handle; register %s first (h = w.register(fn)), or use "
                "callreg.Executor, whose submit takes the callable" % _callable_name(handle),
                code="HANDLE_FOREIGN",
                operation="resolve",
            )
        return self._submit(_raw_handle(handle), self._target(target), self._input(args, kwargs))

    def _submit(self, raw, target, data):
        """The future of a task of raw handle ``raw`` with pickled input
        ``data`` on ``target`` (checked; ``None``: any)."""
        try:
            pending = self._raw.submit(raw, target, data)
        except _callreg.RawError as error:
            future = concurrent.futures.Future()
            future.set_running_or_notify_cancel()
            future.set_exception(_error(error))
            return future
        return _TaskFuture(pending, self._dispatch)

    def call(self, handle, /, *args, target=None, **kwargs):
        """``submit(handle, *args, target=target, **kwargs).result()``, waiting
        without the dispatcher thread. Ctrl-C while it waits raises
        :class:`KeyboardInterrupt` here; the Worker stays usable."""
        raw = _raw_handle(handle)
        target = self._target(target)
        data = self._input(args, kwargs)
        try:
            output = self._raw.call(raw, target, data)
        except _callreg.RawError as error:
            _raise(error)
        return pickle.loads(output)

    def call_all(self, handle, /, *args, **kwargs):
        """Runs the task on every live target; returns ``{target id:
        result}`` in target order. Raises the first failure (in target
        order) once every target answered; :class:`TargetLostError`
        (``NO_LIVE_TARGET``) when no target is live."""
        targets = self.targets
        if not targets:
            # Raises what a call raises then: NO_LIVE_TARGET once started,
            # LIFECYCLE_INVALID before start or after close.
            self.call(handle, *args, **kwargs)
        futures = {t: self.submit(handle, *args, target=t, **kwargs) for t in targets}
        results = {}
        first = None
        for target, future in futures.items():
            try:
                results[target] = future.result()
            except BaseException as error:
                if first is None:
                    first = error
        if first is not None:
            raise first
        return results

    def map(self, handle, /, *iterables, timeout=None, chunksize=1):
        """Like :meth:`concurrent.futures.Executor.map`: submits
        ``handle(*items)`` for each tuple of items at once, spread over the
        live targets, and returns an iterator of the results in order;
        ``timeout`` (seconds from this call) raises
        :class:`concurrent.futures.TimeoutError` for a result not there in
        time. ``chunksize`` items go in one task (one frame each way, the
        calls run in turn in one target, ``specs/python.md`` §3): a call
        that raises fails its chunk, and the iterator raises that error
        when it reaches the chunk. Raises ``ValueError`` unless
        ``chunksize >= 1``."""
        return self._map(_raw_handle(handle), iterables, timeout, chunksize)

    def _map(self, raw, iterables, timeout, chunksize):
        if isinstance(chunksize, bool) or not isinstance(chunksize, int):
            raise TypeError("chunksize must be an int, not %s" % type(chunksize).__name__)
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1, got %d" % chunksize)
        deadline = None if timeout is None else time.monotonic() + timeout
        calls = zip(*iterables, strict=False)  # as map: the shortest ends it
        if chunksize == 1:
            futures = [self._submit(raw, None, self._input(items, {})) for items in calls]
        else:
            futures = []
            while True:
                chunk = list(itertools.islice(calls, chunksize))
                if not chunk:
                    break
                futures.append(self._submit(raw, None, self._chunk_input(chunk)))

        def results():
            try:
                futures.reverse()
                while futures:
                    future = futures.pop()
                    if deadline is None:
                        value = future.result()
                    else:
                        value = future.result(max(0.0, deadline - time.monotonic()))
                    if chunksize == 1:
                        yield value
                    else:
                        yield from value
            finally:
                futures.clear()

        return results()

    @staticmethod
    def _chunk_input(chunk):
        """A chunk's task input: ``([args, ...],)`` pickled."""
        return _dumps_input((chunk,), itertools.chain.from_iterable(chunk))

    # -- inspection ----------------------------------------------------

    @property
    def targets(self):
        """The live target ids, sorted (empty before start and after close)."""
        return self._raw.live_targets()

    @property
    def sub_targets(self):
        """The live SUB target ids, sorted."""
        return [t for t in self._raw.live_targets() if t < self._sub]

    @property
    def next_level_targets(self):
        """The live next-level target ids, sorted (empty without
        ``next_level``)."""
        return [t for t in self._raw.live_targets() if t >= self._sub]

    def target_pid(self, target):
        """The process id of ``target`` (``None`` before start)."""
        return self._raw.target_pid(self._target(target))

    def target_incarnation(self, target):
        """The incarnation of ``target``'s current (or next) process: 0 for
        the one forked at start, one more for each replacement."""
        return self._raw.target_incarnation(self._target(target))

    def slot_phase(self, target):
        """Where ``target``'s slot stands: ``"joined"`` (it serves),
        ``"backing_off"``, ``"spawning"`` or ``"joining"`` (a replacement
        is on its way), or ``"lost"`` (for good)."""
        return self._raw.slot_phase(self._target(target))

    def slot_events(self):
        """What happened to target slots since start, oldest first (the
        last 1024), as dicts: ``{"event": "lost", "target", "incarnation",
        "cause"}`` (a process was lost, and why),
        ``{"event": "spawned", "target", "incarnation", "pid"}``, ``{"event": "spawn_failed", "target", "incarnation",
        "reason"}``, ``{"event": "joined", "target", "incarnation"}``,
        ``{"event": "join_failed", "target", "incarnation", "failure":
        {"code", "message"}}``, ``{"event": "abandoned", "target",
        "failed_joins"}``."""
        return json.loads(self._raw.slot_events_json())

    def inspect(self):
        """The parent's registry and every live target's table, as dicts
        (the JSON forms): ``{"registry": {...}, "targets": {id: {"incarnation":
        n, "installed": [{"hashid", "refcount"}], "tombstones": n} or
        None}}``."""
        registry = json.loads(self._raw.registry_json())
        tables = {}
        if registry.get("lifecycle") == "started":
            try:
                listed = json.loads(self._raw.tables_json())
            except _callreg.RawError as error:
                _raise(error)
            tables = {entry["target"]: entry["table"] for entry in listed}
        return {"registry": registry, "targets": tables}


# The Executor (its own module; it builds on everything above).
from callreg._executor import Executor  # noqa: E402
