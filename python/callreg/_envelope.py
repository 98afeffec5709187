"""Envelopes, hashids and task inputs: what is pickled, and how."""

from __future__ import annotations

import errno
import inspect
import io
import itertools
import os
import pickle
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import cloudpickle

from callreg import _callreg
from callreg._handle import Handle
from callreg._raw_errors import raise_error

_PROTOCOL = pickle.HIGHEST_PROTOCOL

# Types whose values pickle to the same bytes with pickle and cloudpickle.
_PLAIN = frozenset((int, float, complex, str, bytes, bool, type(None)))

_HEADER_LEN = 16


def pack(fn: Callable[..., Any]) -> bytes:
    """The SPYC envelope (bytes) of ``cloudpickle.dumps(fn)``: a 16-byte
    header then the payload. The payload is pickled straight into the
    envelope's buffer (one copy of it in all: what ``cloudpickle.dumps``
    alone costs). Raises what cloudpickle raises for an object it cannot
    pickle."""
    return pack_with(fn, cloudpickle.Pickler)


class InheritingPickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle has no type hints
    """cloudpickle's pickler, except that the objects of ``inherited``
    (functions and classes of ``__main__`` that existed when the targets
    were forked, so that every target's ``__main__`` has them) are pickled
    by name, as ``pickle`` and ``ProcessPoolExecutor`` do, instead of by
    value with a copy of their globals: they then see the target's module
    globals (what an initializer set there)."""

    inherited: ClassVar[dict[int, object]] = {}

    def reducer_override(self, obj: object) -> Any:
        if self.inherited.get(id(obj)) is obj:
            return NotImplemented
        return super().reducer_override(obj)


def main_objects() -> dict[int, object]:
    """{id: object} of the functions and classes of ``__main__`` now."""
    main = sys.modules.get("__main__")
    found: dict[int, object] = {}
    for value in list(vars(main).values()) if main is not None else ():
        if inspect.isfunction(value) or isinstance(value, type):
            if getattr(value, "__module__", None) == "__main__":
                found[id(value)] = value
    return found


def pack_with(fn: object, pickler: Callable[..., Any]) -> bytes:
    """The SPYC envelope of ``fn`` pickled by ``pickler`` (a
    ``cloudpickle.Pickler`` class)."""
    buffer = io.BytesIO()
    buffer.write(bytes(_HEADER_LEN))
    pickler(buffer, protocol=_PROTOCOL).dump(fn)
    size = buffer.tell() - _HEADER_LEN
    buffer.seek(0)
    buffer.write(_callreg.envelope_header(size))
    # The buffer's own bytes, not a copy (nothing else refers to it).
    return buffer.getvalue()


class EnvelopeWriter:
    """The file a pickler writes a callable's payload to: the payload
    stays in memory up to ``SPILL_BYTES``, past them it goes to a sealable
    memory file (``staging_memfd``) written once, which the Worker then
    seals and stages where it is (``specs/staging.md`` step 1): a large
    callable costs the parent one copy of its pickle, not two. A write the
    system has no memory for raises ``MemoryError``. Close it when done."""

    def __init__(self) -> None:
        self._buffer = bytearray(_HEADER_LEN)
        self.fd: int | None = None
        self.size = 0

    def dump(self, obj: object) -> None:
        """Pickles ``obj`` with cloudpickle into this writer."""
        cloudpickle.Pickler(self, protocol=_PROTOCOL).dump(obj)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.fd is None and len(self._buffer) + len(view) > _HEADER_LEN + _callreg.SPILL_BYTES:
            self.fd = _callreg.staging_memfd()
            self._write_fd(memoryview(self._buffer))
            self._buffer = bytearray()
        if self.fd is None:
            self._buffer += view
        else:
            self._write_fd(view)
        self.size += len(view)
        return len(view)

    def _write_fd(self, view: memoryview) -> None:
        assert self.fd is not None
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as failure:
            if failure.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG):
                raise MemoryError("no memory to stage the callable's pickle: %s" % failure) from failure
            raise

    def envelope(self) -> bytes:
        """The envelope's bytes, when it stayed in memory."""
        self._buffer[:_HEADER_LEN] = _callreg.envelope_header(self.size)
        return bytes(self._buffer)

    def finish(self) -> int:
        """Writes the header into the memory file; returns its descriptor."""
        assert self.fd is not None
        os.pwrite(self.fd, _callreg.envelope_header(self.size), 0)
        return self.fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._buffer = bytearray()


def hashid(obj: bytes | bytearray | memoryview | Handle[..., Any] | Callable[..., Any]) -> str:
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
            raise_error(raw)
    if callable(obj):
        return _callreg.envelope_hashid(pack(obj))
    raise TypeError("hashid() takes envelope bytes, a Handle or a callable, not %s" % type(obj).__name__)


def _dumps(obj: object, values: Iterable[object]) -> bytes:
    """``obj`` pickled: with ``pickle`` when every one of its ``values``
    is of a plain type (the bytes cloudpickle would give, for about a
    fifth of its cost), else with cloudpickle."""
    for value in values:
        if type(value) not in _PLAIN:
            dumped: bytes = cloudpickle.dumps(obj, protocol=_PROTOCOL)
            return dumped
    return pickle.dumps(obj, protocol=_PROTOCOL)


def task_input(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bytes:
    """A task's input: ``(args, kwargs)`` pickled."""
    return _dumps((args, kwargs), itertools.chain(args, kwargs.values()))


def chunk_input(chunk: Sequence[tuple[Any, ...]]) -> bytes:
    """A chunk's task input: ``([args, ...],)`` pickled."""
    return _dumps((chunk,), itertools.chain.from_iterable(chunk))
