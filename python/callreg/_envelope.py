"""Envelopes, hashids and task inputs: what is pickled, and how."""

from __future__ import annotations

import errno
import hashlib
import inspect
import io
import itertools
import os
import pickle
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Final

import cloudpickle

from callreg import _callreg
from callreg._handle import Handle
from callreg._raw_errors import raise_error

_PROTOCOL = pickle.HIGHEST_PROTOCOL

# Types whose values pickle to the same bytes with pickle and cloudpickle.
_PLAIN = frozenset((int, float, complex, str, bytes, bool, type(None)))
# A tuple, list or dict argument of at most this many items whose keys
# and values are all of a _PLAIN type is plain too (specs/python.md §3).
_SCANNED_ITEMS = 32

_HEADER_LEN = 16

OUT_OF_BAND_MIN_BYTES: Final = 1 << 20
"""A buffer pickle protocol 5 can send out of band (a numpy array's data,
a ``pickle.PickleBuffer``) of at least this many bytes goes out of band:
the envelope then has the out-of-band form (``specs/formats.md`` §1.1) and
every target maps the buffer copy-on-write from the one sealed memory
file."""


def pack(fn: Callable[..., Any], *, out_of_band: bool = True) -> bytes:
    """The SPYC envelope (bytes) of ``fn`` pickled with cloudpickle: a
    16-byte header then the payload. The payload is pickled straight into
    the envelope's buffer (one copy of it in all: what
    ``cloudpickle.dumps`` alone costs).

    With ``out_of_band`` (the default), each buffer of at least
    :data:`OUT_OF_BAND_MIN_BYTES` that ``fn`` captures and that pickle
    protocol 5 can send out of band (numpy arrays, ``pickle.PickleBuffer``)
    goes after the pickle, in an envelope of the out-of-band form (version
    129, ``specs/formats.md`` §1.1), which targets map rather than copy;
    a callable without such a buffer gets the reference form (version 1),
    byte for byte ``cloudpickle.dumps``'s. ``out_of_band=False`` always
    gives the reference form. Raises what cloudpickle raises for an object
    it cannot pickle."""
    return pack_with(fn, cloudpickle.Pickler, out_of_band=out_of_band)


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
    """{id: object} of the functions and classes of ``__main__`` now that
    pickle can find by name: whose ``__qualname__``, looked up from
    ``__main__``, is that very object. A lambda, a closure or a decorated
    function's wrapper (``<lambda>``, ``<locals>`` in the name), a class
    made under another name (``namedtuple``, ``type()``) or a function
    rebound after it was redefined is not found by name, and so is
    pickled by value like any other callable."""
    main = sys.modules.get("__main__")
    found: dict[int, object] = {}
    for value in list(vars(main).values()) if main is not None else ():
        if inspect.isfunction(value) or isinstance(value, type):
            if getattr(value, "__module__", None) == "__main__" and _by_name(main, value) is value:
                found[id(value)] = value
    return found


def _by_name(module: object, value: object) -> object:
    """What ``value``'s ``__qualname__`` names in ``module`` (``None``
    when nothing)."""
    found: object = module
    for part in str(getattr(value, "__qualname__", "<>")).split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def pack_with(fn: object, pickler: Callable[..., Any], *, out_of_band: bool = True) -> bytes:
    """The SPYC envelope of ``fn`` pickled by ``pickler`` (a
    ``cloudpickle.Pickler`` class), as :func:`pack` says."""
    buffer = io.BytesIO()
    buffer.write(bytes(_HEADER_LEN))
    version = _pickle_into(buffer, buffer.tell, pickler, fn, out_of_band)
    size = buffer.tell() - _HEADER_LEN
    buffer.seek(0)
    buffer.write(_callreg.envelope_header(size, version))
    # The buffer's own bytes, not a copy (nothing else refers to it).
    return buffer.getvalue()


# A write to the memory file at least this long (bytes) is hashed in a
# second thread while it is written.
_PARALLEL_HASH_BYTES: Final = 1 << 20


def _pickle_into(
    file: Any, tell: Callable[[], int], pickler: Callable[..., Any], obj: object, out_of_band: bool
) -> int:
    """Pickles ``obj`` with ``pickler`` into ``file`` after its 16 header
    bytes (``tell()``: where the file ends, from the envelope's first
    byte), then, with ``out_of_band``, the large buffers it left out of
    the pickle (:func:`pack`); returns the envelope's version.
    ``TypeError`` when ``out_of_band`` is not a bool."""
    if not isinstance(out_of_band, bool):
        raise TypeError("out_of_band must be True or False, not %s" % type(out_of_band).__name__)
    taken: list[pickle.PickleBuffer] = []
    pickler(file, protocol=_PROTOCOL, buffer_callback=_taker(taken) if out_of_band else None).dump(obj)
    if not taken:
        return 1
    _write_out_of_band(file.write, tell, tell() - _HEADER_LEN, taken)
    return int(_callreg.OUT_OF_BAND_VERSION)


def _taker(taken: list[pickle.PickleBuffer]) -> Callable[[pickle.PickleBuffer], bool]:
    """A pickler's ``buffer_callback``: takes each buffer of at least
    :data:`OUT_OF_BAND_MIN_BYTES` out of band (into ``taken``) and leaves
    the others in the pickle."""

    def take(buffer: pickle.PickleBuffer) -> bool:
        with buffer.raw() as view:
            if view.nbytes < OUT_OF_BAND_MIN_BYTES:
                return True
        taken.append(buffer)
        return False

    return take


def _write_out_of_band(
    write: Callable[[Any], int], tell: Callable[[], int], pickle_size: int, taken: list[pickle.PickleBuffer]
) -> None:
    """Writes the buffers ``taken`` out of band after a pickle of
    ``pickle_size`` bytes (``tell()`` is where it ends), each at its
    aligned offset, then their table and the footer (``specs/formats.md``
    §1.1): one copy of each buffer's bytes, from where they are."""
    views = [buffer.raw() for buffer in taken]
    try:
        offsets, _ = _callreg.out_of_band_offsets(pickle_size, [view.nbytes for view in views])
        for view, offset in zip(views, offsets, strict=True):
            write(bytes(offset - tell()))
            write(view)
        tail = _callreg.out_of_band_tail(pickle_size, [(o, v.nbytes) for o, v in zip(offsets, views, strict=True)])
        write(tail)
    finally:
        for view in views:
            view.release()


class EnvelopeWriter:
    """The file a pickler writes a callable's payload to: the payload
    stays in memory up to ``SPILL_BYTES``, past them it goes to a sealable
    memory file (``staging_memfd``) written once, which the Worker then
    seals and stages where it is (``specs/staging.md`` step 1): a large
    callable costs the parent one copy of its pickle, not two. A write the
    system has no memory for raises ``MemoryError``. Large out-of-band
    buffers follow the pickle as :func:`pack` says, written once from
    where they are. Once in the memory file, the payload is hashed as it
    is written (:attr:`payload_sha256`), a large write's bytes in a
    second thread while this one writes them, so that the Worker need not
    read them back. Close it when done."""

    def __init__(self) -> None:
        self._buffer = bytearray(_HEADER_LEN)
        self.fd: int | None = None
        self.size = 0
        self.version = 1
        self._sha256: Any = None

    def dump(self, obj: object, *, out_of_band: bool = True) -> None:
        """Pickles ``obj`` with cloudpickle into this writer."""
        self.version = _pickle_into(self, lambda: _HEADER_LEN + self.size, cloudpickle.Pickler, obj, out_of_band)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.fd is None and len(self._buffer) + len(view) > _HEADER_LEN + _callreg.SPILL_BYTES:
            self.fd = _callreg.staging_memfd()
            self._sha256 = hashlib.sha256(memoryview(self._buffer)[_HEADER_LEN:])
            self._write_fd(memoryview(self._buffer))
            self._buffer = bytearray()
        if self.fd is None:
            self._buffer += view
        elif len(view) < _PARALLEL_HASH_BYTES:
            self._sha256.update(view)
            self._write_fd(view)
        else:
            # Both release the GIL: the hash and the write run at once.
            hashing = threading.Thread(target=self._sha256.update, args=(view,), name="callreg-hash")
            hashing.start()
            try:
                self._write_fd(view)
            finally:
                hashing.join()
        self.size += len(view)
        return len(view)

    @property
    def payload_sha256(self) -> bytes:
        """The SHA-256 of the payload written to the memory file (the
        bytes after the header)."""
        assert self._sha256 is not None
        digest: bytes = self._sha256.digest()
        return digest

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
        self._buffer[:_HEADER_LEN] = _callreg.envelope_header(self.size, self.version)
        return bytes(self._buffer)

    def finish(self) -> int:
        """Writes the header into the memory file; returns its descriptor."""
        assert self.fd is not None
        os.pwrite(self.fd, _callreg.envelope_header(self.size, self.version), 0)
        return self.fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._buffer = bytearray()


def hashid(
    obj: bytes | bytearray | memoryview | Handle[..., Any] | Callable[..., Any], *, out_of_band: bool = True
) -> str:
    """The hashid (``"sha256:"`` + 64 hex digits) of envelope bytes, of a
    :class:`Handle`, or of a callable (via :func:`pack`, with its
    ``out_of_band``; two packs of one function give one hashid: that of
    ``Worker.register(fn, out_of_band=...)``'s handle). Raises
    :class:`EnvelopeError` for bytes that are not an envelope,
    ``TypeError`` for anything else."""
    if isinstance(obj, Handle):
        return obj.hashid
    if isinstance(obj, (bytes, bytearray, memoryview)):
        try:
            return _callreg.envelope_hashid(bytes(obj))
        except _callreg.RawError as raw:
            raise_error(raw)
    if callable(obj):
        return _callreg.envelope_hashid(pack(obj, out_of_band=out_of_band))
    raise TypeError("hashid() takes envelope bytes, a Handle or a callable, not %s" % type(obj).__name__)


def _plain(value: object) -> bool:
    """Whether ``value`` pickles to the same bytes with ``pickle`` as with
    cloudpickle, as far as a look at its type (and a small container's
    items' types) tells: a ``_PLAIN`` type, or a tuple, list or dict of
    at most ``_SCANNED_ITEMS`` items of ``_PLAIN`` types (the pickler
    writes these itself, without cloudpickle's reducer)."""
    kind = type(value)
    if kind in _PLAIN:
        return True
    # The exact types (not subclasses), checked with isinstance for the
    # type checker.
    if (kind is tuple or kind is list) and isinstance(value, (tuple, list)):
        return len(value) <= _SCANNED_ITEMS and _PLAIN.issuperset(map(type, value))
    if kind is dict and isinstance(value, dict):
        return (
            len(value) <= _SCANNED_ITEMS
            and _PLAIN.issuperset(map(type, value))
            and _PLAIN.issuperset(map(type, value.values()))
        )
    return False


def _dumps(obj: object, values: Iterable[object]) -> bytes:
    """``obj`` pickled: with ``pickle`` when every one of its ``values``
    is plain (:func:`_plain`: the bytes cloudpickle would give, for about
    a fifth of its cost), else with cloudpickle."""
    for value in values:
        if type(value) not in _PLAIN and not _plain(value):
            dumped: bytes = cloudpickle.dumps(obj, protocol=_PROTOCOL)
            return dumped
    return pickle.dumps(obj, protocol=_PROTOCOL)


def task_input(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bytes:
    """A task's input: ``(args, kwargs)`` pickled."""
    return _dumps((args, kwargs), itertools.chain(args, kwargs.values()) if kwargs else args)


def chunk_input(chunk: Sequence[tuple[Any, ...]]) -> bytes:
    """A chunk's task input: ``([args, ...],)`` pickled."""
    return _dumps((chunk,), itertools.chain.from_iterable(chunk))
