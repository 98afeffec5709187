"""Trees of Workers (``specs/python.md`` §5): what a next-level target
builds (:class:`NextLevel`), its :class:`Context`, and the target
initializer that builds it."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from callreg._handle import Handle
from callreg._options import (
    DEFAULT_CONTROL_TIMEOUT,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_RESPAWN_BACKOFF,
    DEFAULT_RESPAWN_LIMIT,
    DEFAULT_SLOT_CAPACITY,
    DEFAULT_SPIN,
    check_start_method,
    checked_int,
    raw_worker,
)

if TYPE_CHECKING:
    from callreg._worker import Worker


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
    ``respawn_limit``, ``respawn_backoff``, ``spin``, ``start_method`` and
    ``preload`` are the inner Worker's, as in :class:`Worker`, and are
    checked here as the inner Worker checks them (the outer Worker's
    ``spin`` is its own and its targets': the inner Worker's callers and
    targets spin by this one).

    Under the outer Worker's ``start_method="fork"`` the objects are
    inherited by ``fork``, not pickled; under ``"forkserver"`` they are
    pickled with cloudpickle: ``setup`` may be any callable, a lambda or a
    closure included, either way."""

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
        "spin",
        "start_method",
        "preload",
    )

    targets: int | None
    setup: Callable[[Worker], Mapping[str, Handle[..., Any]] | None] | None
    next_level: NextLevel | None
    next_level_targets: int | None
    control_timeout: float
    operation_timeout: float | None
    slot_capacity: int
    max_frame_bytes: int
    probe_first: bool
    respawn_limit: int
    respawn_backoff: float
    spin: float
    start_method: Literal["fork", "forkserver"]
    preload: tuple[str, ...]

    def __init__(
        self,
        targets: int | None = None,
        *,
        setup: Callable[[Worker], Mapping[str, Handle[..., Any]] | None] | None = None,
        next_level: NextLevel | None = None,
        next_level_targets: int | None = None,
        control_timeout: float = DEFAULT_CONTROL_TIMEOUT,
        slot_capacity: int = DEFAULT_SLOT_CAPACITY,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        operation_timeout: float | None = None,
        probe_first: bool = True,
        respawn_limit: int = DEFAULT_RESPAWN_LIMIT,
        respawn_backoff: float = DEFAULT_RESPAWN_BACKOFF,
        spin: float = DEFAULT_SPIN,
        start_method: Literal["fork", "forkserver"] = "fork",
        preload: Iterable[str] = (),
    ) -> None:
        if setup is not None and not callable(setup):
            raise TypeError("setup must be a callable or None, not %s" % type(setup).__name__)
        _, total = counts(targets, next_level, next_level_targets)
        # The inner Worker's options, checked now by what checks them when
        # it is built (in the next-level target, at start).
        raw_worker(
            total,
            control_timeout=control_timeout,
            slot_capacity=slot_capacity,
            max_frame_bytes=max_frame_bytes,
            operation_timeout=operation_timeout,
            probe_first=probe_first,
            respawn_limit=respawn_limit,
            respawn_backoff=respawn_backoff,
            spin=spin,
        ).close()
        preload = check_start_method(start_method, preload)
        self.targets = targets
        self.setup = setup
        self.next_level = next_level
        self.next_level_targets = next_level_targets
        self.control_timeout = control_timeout
        self.operation_timeout = operation_timeout
        self.slot_capacity = slot_capacity
        self.max_frame_bytes = max_frame_bytes
        self.probe_first = probe_first
        self.respawn_limit = respawn_limit
        self.respawn_backoff = respawn_backoff
        self.spin = spin
        self.start_method = start_method
        self.preload = preload

    def __repr__(self) -> str:
        return "<callreg.NextLevel targets=%r next_level_targets=%r next_level=%r>" % (
            self.targets,
            self.next_level_targets,
            self.next_level,
        )


def counts(targets: int | None, next_level: object, next_level_targets: int | None) -> tuple[int, int]:
    """A Worker's (or NextLevel's) SUB target count and count of targets
    of both kinds. What only a tree has is checked here (``targets`` may
    be 0 there, ``next_level_targets`` needs ``next_level``, and both
    share the 65535 target ids); the rest is the extension's to check
    (:func:`callreg._options.raw_worker`)."""
    if next_level is not None and not isinstance(next_level, NextLevel):
        raise TypeError("next_level must be a callreg.NextLevel or None, not %s" % type(next_level).__name__)
    if targets is None:
        targets = os.cpu_count() or 1
    if next_level is None:
        if next_level_targets is not None:
            raise ValueError("next_level_targets needs next_level")
        return targets, targets
    if next_level_targets is None:
        next_level_targets = 1
    targets = checked_int("targets", targets, 0, 0xFFFF)
    next_level_targets = checked_int("next_level_targets", next_level_targets, 1, 0xFFFF)
    if targets > 0xFFFF - next_level_targets:
        raise ValueError(
            "targets must be between 0 and %d with %d next-level targets, got %d"
            % (0xFFFF - next_level_targets, next_level_targets, targets)
        )
    return targets, targets + next_level_targets


class Context:
    """The first argument of every callable run on a next-level target:
    ``inner`` is the next-level child's own :class:`Worker` (started),
    ``handles`` the dict ``setup`` returned, ``target`` this target's id
    in the outer Worker. :func:`context` returns it anywhere in that
    child."""

    __slots__ = ("inner", "handles", "target")

    inner: Worker
    handles: dict[str, Handle[..., Any]]
    target: int

    def __init__(self, inner: Worker, handles: dict[str, Handle[..., Any]], target: int) -> None:
        self.inner = inner
        self.handles = handles
        self.target = target

    def close(self) -> None:
        """Closes the inner Worker (when the next-level target stops)."""
        self.inner.close()

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError("a callreg.Context lives in its next-level target and cannot be pickled")

    def __repr__(self) -> str:
        return "<callreg.Context of target %d, inner %r, handles %s>" % (
            self.target,
            self.inner,
            sorted(self.handles),
        )


_CONTEXT: Context | None = None


def context() -> Context | None:
    """The :class:`Context` of this process when it is a next-level target,
    else ``None`` (in a parent, in a SUB target, after any fork)."""
    return _CONTEXT


def _forget_context() -> None:
    global _CONTEXT
    _CONTEXT = None


# A context (its inner Worker) belongs to the process that built it.
os.register_at_fork(after_in_child=_forget_context)


def initialize_target(
    initializer: Callable[..., object] | None,
    initargs: Iterable[Any],
    sub_targets: int,
    level: NextLevel | None,
    target: int,
) -> Context | None:
    """The target initializer of a Worker (run by the runtime in each of
    its targets and replacements, at their start, before they serve):
    ``initializer(*initargs)``, then, with next-level targets,
    :func:`_start_target`. An exception from ``initializer`` is printed to
    the target's stderr and raised (the target is then lost at start)."""
    if initializer is not None:
        try:
            initializer(*initargs)
        except BaseException:
            traceback.print_exc()
            raise
    if level is None:
        return None
    return _start_target(sub_targets, level, target)


def _start_target(sub_targets: int, level: NextLevel, target: int) -> Context | None:
    """The target initializer of a Worker with next-level targets (run by
    the runtime in each of its targets, at start, on the target's main
    thread): ``None`` on a SUB target; on a next-level target, builds the
    inner Worker, runs ``setup``, starts it and returns the
    :class:`Context`. A failure (``setup`` raising, or a registration of
    ``setup`` failing in the inner targets) is printed to this target's
    stderr and raised (the target is then lost at start)."""
    global _CONTEXT
    from callreg._worker import Worker  # the Worker builds on this module

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
            spin=level.spin,
            start_method=level.start_method,
            preload=level.preload,
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
        traceback.print_exc()
        if inner is not None:
            inner.close()
        raise
    _CONTEXT = Context(inner, handles, target)
    return _CONTEXT
