"""A Worker's options: their defaults, and the extension's Worker they
build.

An option's value is checked once, by what runs it: the extension
refuses a time that is not a positive (a back-off: zero or positive)
finite number of seconds, or is beyond what a deadline holds
(``ValueError``), and the crate's ``WorkerBuilder`` refuses what it
cannot run (no target, no slot, a frame bound below 256 bytes, an
operation timeout shorter than the control timeout:
:class:`LifecycleError`). Checked here is only what the extension's
arguments cannot take, named after the option (its conversion errors do
not name it): the type of each option, and the range of the integers it
takes as unsigned numbers, and the start method with its preload
modules.

"""

from __future__ import annotations

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
# The leader's spin budget (seconds): the crate's default and bound.
DEFAULT_SPIN: Final = _callreg.DEFAULT_SPIN
MAX_SPIN: Final = _callreg.MAX_SPIN

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
    spin: float
    start_method: Literal["fork", "forkserver"]
    preload: Iterable[str]


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
    _check_int("targets", targets, _U16)
    _check_seconds("control_timeout", control_timeout)
    _check_int("slot_capacity", slot_capacity, _U16)
    _check_int("max_frame_bytes", max_frame_bytes, _USIZE)
    if operation_timeout is not None:
        _check_seconds("operation_timeout", operation_timeout)
    if not isinstance(probe_first, bool):
        raise TypeError("probe_first must be True or False, not %s" % type(probe_first).__name__)
    _check_int("respawn_limit", respawn_limit, _U16)
    _check_seconds("respawn_backoff", respawn_backoff)
    _check_seconds("spin", spin)
    if spin > MAX_SPIN:
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
        )
    except _callreg.RawError as raw:
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
) -> tuple[str, list[str], bytes] | None:
    """The extension's ``template`` argument: ``None`` under ``"fork"``."""
    names = check_start_method(start_method, preload)
    if start_method != "forkserver":
        return None
    from callreg._forkserver import template_command  # imports cloudpickle

    return template_command(names, target_initializer)


# The largest values of the extension's unsigned arguments.
_U16: Final = 0xFFFF
_USIZE: Final = 0xFFFF_FFFF_FFFF_FFFF


def _check_int(name: str, value: int, limit: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("%s must be an int, not %s" % (name, type(value).__name__))
    if not 0 <= value <= limit:
        raise ValueError("%s must be between 0 and %d, got %d" % (name, limit, value))


def _check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("%s must be a number of seconds, not %s" % (name, type(value).__name__))
