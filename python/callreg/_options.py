"""A Worker's options: their defaults, and the extension's Worker they
build.

An option's value is checked here, named after the option, with
``TypeError`` for its type and ``ValueError`` for its value, as
``concurrent.futures`` does: the type of each option, the range of each
integer (at least one target and one slot, a frame bound of at least
:data:`MIN_MAX_FRAME_BYTES`), and the start method with its preload
modules. The extension refuses a time that is not a positive (a
back-off: zero or positive) finite number of seconds, or is beyond what
a deadline holds (``ValueError``); what the crate's ``WorkerBuilder``
refuses (``LIFECYCLE_INVALID``: an operation timeout shorter than the
control timeout) is a ``ValueError`` too, with the builder's message.

"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Callable, Iterable
from typing import Final, Literal, TypedDict

from callreg import _callreg
from callreg._raw_errors import raise_error

DEFAULT_MAX_FRAME_BYTES: Final = 256 * 1024 * 1024
"""The default bound (bytes) on one task's pickled arguments, and on its
pickled result, with a few bytes of framing."""

DEFAULT_CONTROL_TIMEOUT: Final = 30.0
DEFAULT_SLOT_CAPACITY: Final = 64
DEFAULT_RESPAWN_LIMIT: Final = 3
DEFAULT_RESPAWN_BACKOFF: Final = 0.1
# The spin budget (seconds) of a Worker's leaders and its targets' task
# threads: the crate's default and bound.
DEFAULT_SPIN: Final = _callreg.DEFAULT_SPIN
MAX_SPIN: Final = _callreg.MAX_SPIN
# The smallest max_frame_bytes (bytes): the crate's bound.
MIN_MAX_FRAME_BYTES: Final = _callreg.MIN_MAX_FRAME_BYTES

# How a Worker makes its targets (``specs/python.md``, "Start methods").
START_METHODS: Final = ("fork", "forkserver")


class WorkerOptions(TypedDict, total=False):
    """The options of a :class:`Worker` that an :class:`Executor` passes
    on (as keyword arguments)."""

    control_timeout: float
    slot_capacity: int
    max_frame_bytes: int
    operation_timeout: float | None
    probe_first: bool
    respawn_limit: int
    respawn_backoff: float
    max_tasks_per_target: int
    spin: float
    start_method: Literal["fork", "forkserver"]
    preload: Iterable[str]


WORKER_OPTIONS: Final = frozenset(WorkerOptions.__required_keys__ | WorkerOptions.__optional_keys__)
"""The names of :class:`WorkerOptions`."""


def raw_worker(
    targets: int,
    *,
    control_timeout: float,
    slot_capacity: int,
    max_frame_bytes: int,
    operation_timeout: float | None,
    probe_first: bool,
    respawn_limit: int,
    respawn_backoff: float,
    max_tasks_per_target: int = 0,
    spin: float = DEFAULT_SPIN,
    target_initializer: Callable[[int], object] | None = None,
    start_method: str = "fork",
    preload: Iterable[str] = (),
) -> _callreg.RawWorker:
    """The extension's Worker of ``targets`` targets with these options,
    not started; raises what the extension and the builder raise for an
    option they refuse (the module docs), ``ValueError`` for a start
    method other than ``"fork"`` and ``"forkserver"`` or preload modules
    without ``"forkserver"``, ``TypeError`` for a preload entry that is
    not a str."""
    targets = checked_int("targets", targets, 1, _U16)
    control_timeout = checked_seconds("control_timeout", control_timeout)
    slot_capacity = checked_int("slot_capacity", slot_capacity, 1, _U16)
    max_frame_bytes = checked_int("max_frame_bytes", max_frame_bytes, MIN_MAX_FRAME_BYTES, _USIZE)
    if operation_timeout is not None:
        operation_timeout = checked_seconds("operation_timeout", operation_timeout)
    if not isinstance(probe_first, bool):
        raise TypeError("probe_first must be True or False, not %s" % type(probe_first).__name__)
    respawn_limit = checked_int("respawn_limit", respawn_limit, 0, _U16)
    respawn_backoff = checked_seconds("respawn_backoff", respawn_backoff)
    max_tasks_per_target = checked_int("max_tasks_per_target", max_tasks_per_target, 0, _U32)
    spin = checked_seconds("spin", spin)
    # The budget is kept in whole nanoseconds: a value that rounds to the
    # bound is the bound (numpy.float32(1e-3) is 1.0000000475e-3).
    if spin > MAX_SPIN and not spin * 1e9 < round(MAX_SPIN * 1e9) + 0.5:
        raise ValueError("spin must be at most %r seconds, got %r" % (MAX_SPIN, spin))
    template = _template(start_method, preload, target_initializer)
    if template is not None:
        # The template's runtime data carries it.
        target_initializer = None
    try:
        return _callreg.RawWorker(
            targets,
            control_timeout,
            slot_capacity,
            max_frame_bytes,
            target_initializer,
            operation_timeout,
            probe_first,
            respawn_limit,
            respawn_backoff,
            template,
            spin,
            max_tasks_per_target,
        )
    except _callreg.RawError as raw:
        if raw.args[0]["code"] == "LIFECYCLE_INVALID":
            # What the builder refuses is an option's value.
            raise ValueError(raw.args[0]["message"]) from None
        raise_error(raw)


def check_start_method(start_method: str, preload: Iterable[str]) -> tuple[str, ...]:
    """The preload module names, once ``start_method`` and ``preload`` are
    checked (the errors of :func:`raw_worker`)."""
    if start_method not in START_METHODS:
        raise ValueError("start_method must be 'fork' or 'forkserver', not %r" % (start_method,))
    if isinstance(preload, str):
        raise TypeError("preload must be an iterable of module names, not a str")
    names = tuple(preload)
    for name in names:
        if not isinstance(name, str):
            raise TypeError("preload must hold module names (str), not %s" % type(name).__name__)
    if names and start_method != "forkserver":
        raise ValueError(
            "preload needs start_method='forkserver' (under 'fork' targets inherit this interpreter's modules)"
        )
    return names


def _template(
    start_method: str, preload: Iterable[str], target_initializer: Callable[[int], object] | None
) -> tuple[str, list[str], bytes, str | None] | None:
    """The extension's ``template`` argument: ``None`` under ``"fork"``."""
    names = check_start_method(start_method, preload)
    if start_method != "forkserver":
        return None
    from callreg._forkserver import template_command  # imports cloudpickle

    return template_command(names, target_initializer)


# The largest values of the extension's unsigned arguments.
_U16: Final = 0xFFFF
_U32: Final = 0xFFFF_FFFF
_USIZE: Final = 0xFFFF_FFFF_FFFF_FFFF


def checked_int(name: str, value: object, least: int, most: int) -> int:
    """``value`` as an ``int``: any integer (numpy's too) but a bool;
    ``TypeError`` for anything else, ``ValueError`` outside
    ``least..most``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError("%s must be an int, not %s" % (name, type(value).__name__))
    number = int(value)
    if not least <= number <= most:
        raise ValueError("%s must be an int from %d to %d, got %d" % (name, least, most, number))
    return number


def checked_seconds(name: str, value: object, *, zero_ok: bool | None = None) -> float:
    """``value`` (seconds) as a ``float``: any real number (numpy's too)
    but a bool; ``TypeError`` for anything else, ``ValueError`` for one
    too large for a float (an int past about 1.8e308). With ``zero_ok``
    given, also ``ValueError`` unless it is finite and positive (or zero,
    when ``zero_ok``); without, the extension judges the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError("%s must be a number of seconds, not %s" % (name, type(value).__name__))
    try:
        seconds = float(value)
    except OverflowError:
        raise ValueError("%s must be a finite number of seconds, got %s" % (name, reprlib.repr(value))) from None
    if zero_ok is not None and not (math.isfinite(seconds) and (seconds > 0 or (zero_ok and seconds == 0))):
        raise ValueError(
            "%s must be %s and finite, got %r" % (name, "zero or positive" if zero_ok else "positive", seconds)
        )
    return seconds
