"""What a register takes: the callable check, the callable's name, and
its side-car metadata (``specs/metadata.md``)."""

from __future__ import annotations

import functools
import inspect
import json
import platform
import types
from collections.abc import Mapping
from typing import Any

import cloudpickle

from callreg._errors import CallregError
from callreg._handle import Handle

# Objects whose attributes are their own: reading one calls no
# ``__getattr__`` of a user's class.
_FUNCTION_LIKE: tuple[type, ...] = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.MethodWrapperType,
    type,
    functools.partial,
)


def own_attribute(obj: object, name: str) -> Any:
    """``obj``'s attribute ``name`` (``None`` when it has none), read
    without calling a ``__getattr__`` of its class (which could raise
    something else than ``AttributeError``, or add what it was asked
    for): from a function, method, class or partial as usual; from any
    other object only from its instance ``__dict__``, where
    ``functools.update_wrapper`` puts a wrapper's names."""
    if isinstance(obj, _FUNCTION_LIKE):
        return getattr(obj, name, None)
    try:
        attributes = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return None
    return attributes.get(name) if isinstance(attributes, dict) else None


def callable_name(fn: object) -> str:
    """The name a callable is known by (its qualified name; a partial's
    function's; else its type's)."""
    name = own_attribute(fn, "__qualname__") or own_attribute(fn, "__name__")
    if not isinstance(name, str) or not name:
        func = own_attribute(fn, "func") if isinstance(fn, functools.partial) else None
        name = own_attribute(func, "__qualname__") or type(fn).__qualname__
    return str(name)


def check_registrable(fn: object, verb: str) -> None:
    """``TypeError`` unless ``fn`` is a callable whose call returns its
    result (not an ``async def`` function's coroutine, nor a generator
    function's generator). Reads no
    attribute of a callable object (:func:`own_attribute`)."""
    if not callable(fn):
        raise TypeError("%s() takes a callable, not %s" % (verb, type(fn).__name__))
    if isinstance(fn, _FUNCTION_LIKE) and (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
        raise TypeError(
            "%s is an async function: its call would return a coroutine, which a target "
            "cannot send back; %s a function that runs it (e.g. with asyncio.run)" % (callable_name(fn), verb)
        )
    if isinstance(fn, _FUNCTION_LIKE) and inspect.isgeneratorfunction(fn):
        raise TypeError(
            "%s is a generator function: its call would return a generator, which a target "
            "cannot send back; %s a function that returns what it yields (e.g. a list of it)"
            % (callable_name(fn), verb)
        )


def default_metadata(name: str) -> dict[str, Any]:
    """The metadata filled in for a callable packed here: its name, this
    interpreter's and cloudpickle's versions."""
    return {
        "name": name,
        "python": {
            "version": platform.python_version(),
            "serializer": "cloudpickle",
            "serializer_version": cloudpickle.__version__,
        },
    }


def _hook_list(hooks: object, key: str) -> list[object]:
    if not isinstance(hooks, (list, tuple)):
        raise TypeError("metadata[%r] must be a list of hook calls" % key)
    out: list[object] = []
    for hook in hooks:
        if isinstance(hook, dict) and isinstance(hook.get("hashid"), Handle):
            hook = dict(hook, hashid=hook["hashid"].hashid)
        out.append(hook)
    return out


def merge_metadata(base: Mapping[str, Any] | None, metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``metadata`` merged over ``base`` (a hook's ``"hashid"`` may be a
    :class:`Handle`); ``base`` when ``metadata`` is ``None``."""
    if metadata is None:
        return None if base is None else dict(base)
    if not isinstance(metadata, Mapping):
        raise TypeError("metadata must be a dict, not %s" % type(metadata).__name__)
    merged = dict(base or {})
    for key, value in metadata.items():
        if key in ("call_before", "call_after"):
            value = _hook_list(value, key)
        merged[key] = value
    return merged


def metadata_json(meta: Mapping[str, Any]) -> str:
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
