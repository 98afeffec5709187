"""What a Worker tells of its targets: which serve, their processes,
their replacement history, their tables."""

from __future__ import annotations

import json
import numbers
import warnings
from typing import Any

from callreg import _callreg
from callreg._raw_errors import raise_error


class Inspection:
    """The inspection methods of a :class:`Worker` (its base class), and
    its check of a target id."""

    _raw: _callreg.RawWorker
    # Target ids: 0 .. _count - 1; SUB targets below _sub.
    _count: int
    _sub: int

    def _target(self, target: int | None) -> int | None:
        """A task's ``target=``: ``None`` (any) or a target id."""
        if target is None:
            return None
        if isinstance(target, bool) or not isinstance(target, numbers.Integral):
            raise TypeError("target must be an int or None, not %s" % type(target).__name__)
        return self._target_id(target)

    def _target_id(self, target: int) -> int:
        """``target``, checked to be one of this Worker's target ids."""
        if isinstance(target, bool) or not isinstance(target, numbers.Integral):
            raise TypeError("target must be an int, not %s" % type(target).__name__)
        target = int(target)
        if not 0 <= target < self._count:
            raise ValueError(
                "target must be in 0..%d (the Worker's %d target ids), got %d" % (self._count - 1, self._count, target)
            )
        return target

    @property
    def targets(self) -> list[int]:
        """The live target ids, sorted (empty before start and after close)."""
        return self._raw.live_targets()

    @property
    def sub_targets(self) -> list[int]:
        """The live SUB target ids, sorted."""
        return [t for t in self._raw.live_targets() if t < self._sub]

    @property
    def next_level_targets(self) -> list[int]:
        """The live next-level target ids, sorted (empty without
        ``next_level``)."""
        return [t for t in self._raw.live_targets() if t >= self._sub]

    def target_pid(self, target: int) -> int | None:
        """The process id of ``target`` (``None`` before start)."""
        return self._raw.target_pid(self._target_id(target))

    def target_incarnation(self, target: int) -> int:
        """The incarnation of ``target``'s current (or next) process: 0 for
        the one forked at start, one more for each replacement."""
        return self._raw.target_incarnation(self._target_id(target))

    def target_phase(self, target: int) -> str:
        """Where ``target`` stands: ``"joined"`` (it serves),
        ``"backing_off"``, ``"spawning"`` or ``"joining"`` (a replacement
        is on its way), or ``"lost"`` (for good)."""
        return self._raw.target_phase(self._target_id(target))

    def target_state(self, target: int) -> tuple[str, int]:
        """``(target_phase(target), target_incarnation(target))`` read
        together: the phase is that incarnation's. Two separate calls can
        pair a lost process's phase with its replacement's incarnation;
        poll this one to wait for a replacement, e.g. until it returns
        ``("joined", 1)``. Raises ``ValueError`` for a target that does
        not exist."""
        phase, incarnation = self._raw.target_state(self._target_id(target))
        return phase, incarnation

    def target_events(self) -> list[dict[str, Any]]:
        """What happened to targets since start, oldest first (the
        last 1024), as dicts: ``{"event": "lost", "target", "incarnation",
        "cause"}`` (a process was lost, and why),
        ``{"event": "spawned", "target", "incarnation", "pid"}``, ``{"event": "spawn_failed", "target", "incarnation",
        "reason"}``, ``{"event": "joined", "target", "incarnation"}``,
        ``{"event": "join_failed", "target", "incarnation", "failure":
        {"code", "message"}}``, ``{"event": "template_lost", "cause"}``
        (the process that starts replacements is gone: every target lost
        from then on is abandoned at once), ``{"event": "abandoned",
        "target", "failed_joins"}``, ``{"event": "retired", "target",
        "incarnation", "tasks"}`` (a process was sent its
        ``max_tasks_per_target`` tasks, they ended, and it was replaced)."""
        events: list[dict[str, Any]] = json.loads(self._raw.target_events_json())
        return events

    def slot_phase(self, target: int) -> str:
        """Deprecated alias of :meth:`target_phase` (warns
        ``DeprecationWarning``)."""
        _deprecated("slot_phase", "target_phase")
        return self.target_phase(target)

    def slot_state(self, target: int) -> tuple[str, int]:
        """Deprecated alias of :meth:`target_state` (warns
        ``DeprecationWarning``)."""
        _deprecated("slot_state", "target_state")
        return self.target_state(target)

    def slot_events(self) -> list[dict[str, Any]]:
        """Deprecated alias of :meth:`target_events` (warns
        ``DeprecationWarning``)."""
        _deprecated("slot_events", "target_events")
        return self.target_events()

    def inspect(self) -> dict[str, Any]:
        """The parent's registry and every live target's table, as dicts
        (the JSON forms): ``{"registry": {...}, "targets": {id: {"incarnation":
        n, "installed": [{"hashid", "refcount"}], "tombstones": n} or
        None}}``."""
        registry = json.loads(self._raw.registry_json())
        tables: dict[int, Any] = {}
        if registry.get("lifecycle") == "started":
            try:
                listed = json.loads(self._raw.tables_json())
            except _callreg.RawError as failure:
                raise_error(failure)
            tables = {entry["target"]: entry["table"] for entry in listed}
        return {"registry": registry, "targets": tables}


def _deprecated(old: str, new: str) -> None:
    """Warns that ``Worker.old`` is deprecated in favour of ``Worker.new``,
    pointing at the caller of the deprecated method."""
    warnings.warn("Worker.%s is deprecated; use Worker.%s" % (old, new), DeprecationWarning, stacklevel=3)
