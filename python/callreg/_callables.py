"""What a register takes: the callable check, the callable's name, and
its side-car metadata (``specs/metadata.md``)."""

from __future__ import annotations

import inspect
import json
import platform
from collections.abc import Mapping
from typing import Any

import cloudpickle

from callreg._errors import CallregError
from callreg._handle import Handle


def callable_name(fn: object) -> str:
    """The name a callable is known by (its qualified name; a partial's
    function's; else its type's)."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name:
        func = getattr(fn, "func", None)  # functools.partial
        name = getattr(func, "__qualname__", None) or type(fn).__qualname__
    return str(name)


def check_registrable(fn: object, verb: str) -> None:
    """``TypeError`` unless ``fn`` is a callable whose call returns its
    result (not an ``async def`` function's coroutine)."""
    if not callable(fn):
        raise TypeError("%s() takes a callable, not %s" % (verb, type(fn).__name__))
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(
            "%s is an async function: its call would return a coroutine, which a target "
            "cannot send back; %s a function that runs it (e.g. with asyncio.run)" % (callable_name(fn), verb)
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
