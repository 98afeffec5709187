"""Handles: what :meth:`Worker.register` returns."""

from __future__ import annotations

from typing import Any, Final, Generic, NoReturn, ParamSpec, TypeVar

from callreg import _callreg
from callreg._errors import HandleError

_P = ParamSpec("_P")
_R = TypeVar("_R")

KIND: Final = "PYTHON_SERIALIZED"
"""The descriptor kind of every handle."""

NAMESPACE: Final = "LOCAL_PYTHON"
"""The target namespace of every handle."""


class Handle(Generic[_P, _R]):
    """A registration, returned by :meth:`Worker.register`: immutable,
    hashable, equal only to itself (two registers of one function give two
    unequal handles with one hashid). It cannot be pickled or built by hand;
    another Worker refuses it (:class:`HandleError`, ``HANDLE_FOREIGN``), and
    so does its own after :meth:`Worker.unregister` (``HANDLE_STALE``).

    Generic in the callable's parameters and result (``Handle[[int, int],
    int]`` for ``def add(a: int, b: int) -> int``), for type checkers."""

    __slots__ = ("_raw", "__weakref__")

    _raw: _callreg.RawHandle

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a Handle is returned by Worker.register, not built directly")

    @classmethod
    def _of(cls, raw: _callreg.RawHandle) -> Handle[..., Any]:
        handle: Handle[..., Any] = object.__new__(cls)
        object.__setattr__(handle, "_raw", raw)
        return handle

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError("a Handle is immutable")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError("a Handle is immutable")

    def __reduce__(self) -> NoReturn:
        raise TypeError("a Handle cannot be pickled: it is valid only in the Worker that issued it")

    def __copy__(self) -> Handle[_P, _R]:
        return self

    def __deepcopy__(self, memo: object) -> Handle[_P, _R]:
        return self

    @property
    def hashid(self) -> str:
        """The callable's hashid, ``"sha256:"`` + 64 lowercase hex digits."""
        return self._raw.hashid

    @property
    def digest(self) -> bytes:
        """The hashid's 32 bytes."""
        return self._raw.digest

    @property
    def kind(self) -> str:
        """``"PYTHON_SERIALIZED"``."""
        return KIND

    @property
    def namespace(self) -> str:
        """``"LOCAL_PYTHON"``."""
        return self._raw.namespace

    def __repr__(self) -> str:
        return "<callreg.Handle %s #%d %s>" % (self.hashid, self._raw.handle_id, self.namespace)


def raw_handle(handle: object) -> _callreg.RawHandle:
    """The extension's handle of ``handle``; :class:`HandleError`
    (``HANDLE_FOREIGN``) unless it is a :class:`Handle`."""
    if not isinstance(handle, Handle):
        raise HandleError(
            "%r is not a Handle returned by Worker.register" % (handle,),
            code="HANDLE_FOREIGN",
            operation="resolve",
        )
    return handle._raw
