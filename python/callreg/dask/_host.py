"""What each Dask worker runs for the registry (``specs/python.md`` §6):
a callreg Worker that installs what the registry sends, and the task
functions that run a callable by its hashid there."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Mapping
from typing import Any, cast

import distributed
from distributed.diagnostics.plugin import WorkerPlugin

from callreg._errors import CallregError, HandleError, LifecycleError, TargetLostError
from callreg._handle import Handle

HOST_PLUGIN = "callreg-host"
"""The worker plugin's name: one callreg Worker per Dask worker."""


def _failure(exc: BaseException) -> tuple[str, str]:
    """A control's failure for the registry: a callreg error's code and
    text, or ``IO_FAILED`` for anything else."""
    if isinstance(exc, CallregError):
        text = str(exc)
        # The message without the code it starts with (the reply has both).
        return (exc.code, text[len(exc.code) + 2 :] if text.startswith(exc.code + ": ") else text)
    return ("IO_FAILED", "%s: %s" % (type(exc).__name__, exc))


class _Host(WorkerPlugin):
    """One callreg Worker in a Dask worker: installs what the registry
    sends, and runs the tasks that name it."""

    idempotent = True
    name = HOST_PLUGIN

    def __init__(self, targets: int, options: Mapping[str, Any], join_wait: float) -> None:
        self.targets = targets
        self.options = dict(options)
        self.join_wait = join_wait

    async def setup(self, worker: Any) -> None:
        from callreg._worker import Worker

        self.handles: dict[str, list[Handle[..., Any]]] = {}
        self.serving = threading.Event()
        self.changed = threading.Condition()
        options = {"start_method": "forkserver", **self.options}
        self.local = Worker(self.targets, **options)
        await asyncio.to_thread(self.local.start)
        self.address = worker.address
        worker.handlers["callreg_control"] = self.handle_control
        answer = await worker.scheduler.callreg_arrive(address=worker.address)
        if "error" in answer:
            raise RuntimeError("callreg: %s" % answer["error"])

    async def teardown(self, worker: Any) -> None:
        worker.handlers.pop("callreg_control", None)
        await asyncio.to_thread(self.local.close)

    async def handle_control(self, frame: dict[str, Any]) -> dict[str, Any]:
        kind = frame["kind"]
        if kind == "joined":
            self.serving.set()
            with self.changed:
                self.changed.notify_all()
            return {}
        hashid = frame["hashid"]
        try:
            if kind == "register":
                meta = None if frame["metadata"] is None else json.loads(frame["metadata"])
                handle = await asyncio.to_thread(self.local.register_envelope, frame["envelope"], metadata=meta)
                with self.changed:
                    self.handles.setdefault(hashid, []).append(handle)
                    self.changed.notify_all()
            elif kind == "unregister":
                with self.changed:
                    held = self.handles.get(hashid)
                    if not held:
                        return {"failure": ["HANDLE_STALE", "%s is not installed here" % hashid]}
                    handle = held.pop()
                    if not held:
                        del self.handles[hashid]
                try:
                    await asyncio.to_thread(self.local.unregister, handle)
                except TargetLostError:
                    # Released all the same: the local target lost under it
                    # holds nothing, nor does its replacement (the worker
                    # still serves, and agrees with the cluster).
                    pass
            else:
                return {"failure": ["FRAME_INVALID", "a Dask worker takes no %r frame" % kind]}
        except Exception as exc:  # noqa: BLE001 -- every failure is the reply
            code, message = _failure(exc)
            # The worker's address says which worker; its message names its
            # own targets.
            return {"failure": [code, "on %s: %s" % (self.address, message)]}
        return {"failure": None}

    def handle(self, hashid: str) -> Handle[..., Any]:
        """The local handle of ``hashid``, waiting while this worker joins."""
        deadline = time.monotonic() + self.join_wait
        with self.changed:
            while True:
                held = self.handles.get(hashid)
                if held:
                    return held[-1]
                left = deadline - time.monotonic()
                if self.serving.is_set() or left <= 0:
                    raise HandleError(
                        "%s is not registered in this cluster (unregistered, or never registered)" % hashid,
                        code="HANDLE_STALE",
                        operation="resolve",
                    )
                self.changed.wait(left)


def _host() -> _Host:
    plugin = distributed.get_worker().plugins.get(HOST_PLUGIN)
    if plugin is None:
        raise LifecycleError("this Dask worker hosts no callreg Worker (the Cluster closed)", code="LIFECYCLE_INVALID")
    return cast(_Host, plugin)


def _run(digest: bytes, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A task on a Dask worker: the callable whose digest (32 bytes) is
    ``digest`` runs in a target of this worker's callreg Worker."""
    host = _host()
    return host.local.call(host.handle("sha256:" + digest.hex()), *args, **kwargs)


def _run_all(digest: bytes, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, Any]:
    """:func:`_run` on every target of this worker's callreg Worker."""
    host = _host()
    return host.local.call_all(host.handle("sha256:" + digest.hex()), *args, **kwargs)
