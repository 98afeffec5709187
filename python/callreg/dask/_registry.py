"""The cluster's registry on the Dask scheduler (``specs/python.md``
§6): the parent machine with each serving Dask worker as a target, Dask's
comms as the transport. IO only; the machine decides every outcome."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from callreg import _callreg

REGISTRY_PLUGIN = "callreg-registry"
"""The scheduler plugin's name: one registry per scheduler."""


def _now() -> int:
    """Microseconds on the monotonic clock (the machine's time)."""
    return time.monotonic_ns() // 1000


class _Registry(SchedulerPlugin):
    """The cluster's registry, on the scheduler: the parent machine with
    each serving Dask worker as a target (``specs/python.md`` §6).

    IO only: it moves envelopes, frames and replies between the machine
    and the workers and turns the scheduler's worker events into the
    machine's inputs; the machine decides every outcome."""

    idempotent = True
    name = REGISTRY_PLUGIN

    def __init__(
        self,
        *,
        max_workers: int,
        control_timeout: float,
        probe_first: bool,
        respawn_limit: int,
        respawn_backoff: float,
    ) -> None:
        self.targets = max_workers
        self.options: dict[str, Any] = {
            "control_timeout": control_timeout,
            "operation_timeout": control_timeout * 4,
            "probe_first": probe_first,
            "respawn_limit": respawn_limit,
            "respawn_backoff": respawn_backoff,
            # No startup snapshot: every callable is registered after start.
            "slot_capacity": 1,
        }

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.machine = _callreg.RawParent(self.targets, owner=secrets.randbits(64), **self.options)
        self.machine.start()
        # Target id -> (address, incarnation) of the worker in it.
        self.serving: dict[int, tuple[str, int]] = {}
        self.position: dict[str, tuple[int, int]] = {}
        self.open: dict[int, int] = {}  # open target id -> incarnation
        self.joined: set[str] = set()
        self.envelopes: dict[str, tuple[bytes, str | None]] = {}
        self.staged: dict[int, str] = {}
        self.waiting: dict[int, asyncio.Future[tuple[Any, Any, Any]]] = {}
        self.queues: dict[str, asyncio.Queue[dict[str, Any] | None]] = {}
        self.events: list[tuple[str, ...]] = []
        self.wake = asyncio.Event()
        now = _now()
        # Every target starts open: each worker arrives, those here now
        # included (specs/protocol.md §2.9, "Arrivals").
        for target in range(self.targets):
            self.machine.target_left(target, "no worker arrived yet", now)
        self._pump()
        self.handlers = {
            "callreg_register": self.handle_register,
            "callreg_unregister": self.handle_unregister,
            "callreg_arrive": self.handle_arrive,
            "callreg_state": self.handle_state,
            "callreg_close": self.handle_close,
        }
        self.closed = False
        scheduler.handlers.update(self.handlers)
        self.timer = asyncio.ensure_future(self._deadlines())

    async def handle_close(self) -> dict[str, Any]:
        """A Cluster's close: the registry ends."""
        await self.close()
        return {}

    async def close(self) -> None:
        """Ends the registry (a Cluster's close, or the scheduler's):
        operations in flight fail ``LIFECYCLE_INVALID``, no frame is sent
        any more. Idempotent."""
        if self.closed:
            return
        self.closed = True
        # A later Cluster on this scheduler starts a registry of its own;
        # until then a client's call finds no handler (an error naming it).
        for name, handler in self.handlers.items():
            if self.scheduler.handlers.get(name) == handler:
                del self.scheduler.handlers[name]
        self.timer.cancel()
        self.machine.close()
        self._pump()
        for queue in self.queues.values():
            queue.put_nowait(None)

    # The scheduler's worker events.

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        self._leave(worker, "the Dask worker left the cluster")

    def _leave(self, address: str, cause: str) -> None:
        place = self.position.pop(address, None)
        self.joined.discard(address)
        queue = self.queues.pop(address, None)
        if queue is not None:
            queue.put_nowait(None)
        if place is None:
            return
        target, _ = place
        self.serving.pop(target, None)
        self.machine.target_left(target, cause, _now())
        self._pump()

    async def handle_arrive(self, address: str) -> dict[str, Any]:
        """A Dask worker's host is ready: it takes the lowest open target."""
        if address not in self.scheduler.workers:
            return {"error": "%s is not a worker of this scheduler" % address}
        if address in self.position:
            return {"target": self.position[address][0]}
        if not self.open:
            return {"error": "every one of the registry's %d targets is taken" % self.targets}
        target = min(self.open)
        incarnation = self.open.pop(target)
        self.position[address] = (target, incarnation)
        self.serving[target] = (address, incarnation)
        self.queues[address] = asyncio.Queue()
        asyncio.ensure_future(self._sender(address, target, incarnation, self.queues[address]))
        self.machine.target_spawned(target, incarnation, _now())
        self._pump()
        return {"target": target}

    async def handle_state(self) -> dict[str, Any]:
        """The serving workers and the registry's live handles."""
        return {
            "workers": sorted(self.joined),
            "handles": [h.to_json() for h in self.machine.live_handles()],
            "events": list(self.events[-100:]),
        }

    # The client's operations.

    async def handle_register(self, envelope: bytes, metadata: str | None) -> dict[str, Any]:
        try:
            hashid = _callreg.envelope_hashid(envelope)
            op = self.machine.register(hashid, metadata, _now())
        except _callreg.RawError as failure:
            return {"error": failure.args[0]}
        except ValueError as failure:
            return {"error": {"code": "ENVELOPE_INVALID", "message": str(failure)}}
        self.envelopes.setdefault(hashid, (envelope, metadata))
        return await self._completion(op)

    async def handle_unregister(self, handle: str) -> dict[str, Any]:
        try:
            op = self.machine.unregister(_callreg.RawHandle.from_json(handle), _now())
        except _callreg.RawError as failure:
            return {"error": failure.args[0]}
        except ValueError as failure:
            return {"error": {"code": "HANDLE_FOREIGN", "message": str(failure)}}
        return await self._completion(op)

    async def _completion(self, op: int) -> dict[str, Any]:
        done: asyncio.Future[tuple[Any, Any, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[op] = done
        self._pump()
        handle, failure, outcomes = await done
        if failure is not None:
            return {"error": failure}
        return {"handle": handle.to_json(), "outcomes": outcomes}

    # Effects.

    def _pump(self) -> None:
        """Carries out the machine's effects, in order."""
        for effect in self.machine.effects():
            kind = effect[0]
            if kind in ("stage", "restage"):
                self.staged[effect[1]] = effect[2]
            elif kind == "send":
                _, target, frame, seq, hashid, staging = effect
                address = self.serving[target][0]
                message: dict[str, Any] = {"kind": frame, "seq": seq, "hashid": hashid}
                if staging is not None:
                    message["envelope"], message["metadata"] = self.envelopes[self.staged[staging]]
                self.queues[address].put_nowait(message)
            elif kind == "verify":
                # A hint (verify a payload before its register comes): a
                # cluster's workers receive the envelope with the register,
                # so there is nothing to send ahead.
                pass
            elif kind == "release":
                hashid = self.staged.pop(effect[1])
                if hashid not in self.staged.values() and not self.machine.keeps_envelope(hashid):
                    self.envelopes.pop(hashid, None)
            elif kind == "fence":
                self._fence(effect[1])
            elif kind == "spawn":
                self.open[effect[1]] = effect[2]
            elif kind == "joined":
                address = self.serving[effect[1]][0]
                self.joined.add(address)
                self.queues[address].put_nowait({"kind": "joined"})
                self.events.append(("joined", address))
            elif kind in ("join_failed", "abandoned"):
                self.events.append(tuple(str(x) for x in effect))
            elif kind == "completed":
                _, op, handle, failure, outcomes = effect
                done = self.waiting.pop(op, None)
                if done is not None and not done.done():
                    done.set_result((handle, failure, [[t, text] for t, text in outcomes]))
                for hashid in list(self.envelopes):
                    if hashid not in self.staged.values() and not self.machine.keeps_envelope(hashid):
                        del self.envelopes[hashid]
        self.wake.set()

    def _fence(self, target: int) -> None:
        """The machine counts ``target`` lost: the scheduler removes its
        worker and closes it (it must not serve; what it holds is gone
        with it)."""
        address, _ = self.serving.pop(target)
        self.position.pop(address, None)
        self.joined.discard(address)
        queue = self.queues.pop(address, None)
        if queue is not None:
            queue.put_nowait(None)
        self.events.append(("fenced", address))
        asyncio.ensure_future(
            self.scheduler.remove_worker(address, stimulus_id="callreg-fence-%s" % uuid.uuid4().hex, close=True)
        )

    async def _sender(self, address: str, target: int, incarnation: int, queue: asyncio.Queue[Any]) -> None:
        """Sends one worker its frames in order, each after the answer to
        the one before, and hands each answer to the machine while the
        worker still holds the target (a reply after its removal is
        dropped here: the machine already counts it lost)."""
        rpc = self.scheduler.rpc(address)
        while True:
            message = await queue.get()
            if message is None:
                return
            try:
                reply = await self._answer(rpc, address, (target, incarnation), message)
            except Exception as exc:  # noqa: BLE001 -- any comm failure ends the worker's place
                if self.position.get(address) == (target, incarnation):
                    self._leave(address, "its connection failed: %s: %s" % (type(exc).__name__, exc))
                    asyncio.ensure_future(
                        self.scheduler.remove_worker(
                            address, stimulus_id="callreg-comm-%s" % uuid.uuid4().hex, close=True
                        )
                    )
                return
            if message["kind"] == "joined" or self.position.get(address) != (target, incarnation):
                continue
            if not isinstance(reply, dict):
                # Not the host's answer (its handler is gone: it tore down).
                reply = {"failure": ["IO_FAILED", "the Dask worker answered %r" % (reply,)]}
            failure = reply.get("failure")
            try:
                self.machine.handle_reply(
                    target, message["seq"], message["hashid"], None if failure is None else tuple(failure), _now()
                )
            except _callreg.RawError as refused:
                self.events.append(("reply_refused", address, str(refused.args[0].get("message"))))
            self._pump()

    async def _answer(self, rpc: Any, address: str, place: tuple[int, int], message: dict[str, Any]) -> Any:
        """The worker's answer to ``message``. While it is awaited, the
        worker's Dask heartbeats are its alive reports (``specs/protocol.md``
        §2.7): each quarter of the control timeout in which the scheduler
        heard from the worker moves its silence deadline, so that an
        install longer than the control timeout (a large callable, a slow
        import) is bounded by the operation timeout, while a worker that
        stops heartbeating is fenced for silence."""
        call = asyncio.ensure_future(rpc.callreg_control(frame=message))
        every = self.options["control_timeout"] / 4
        worker = self.scheduler.workers.get(address)
        heard = worker.last_seen if worker is not None else 0.0
        while True:
            done, _ = await asyncio.wait({call}, timeout=every)
            if done:
                return call.result()
            worker = self.scheduler.workers.get(address)
            if worker is None or worker.last_seen <= heard or message["kind"] == "joined":
                continue
            heard = worker.last_seen
            if self.position.get(address) != place:
                continue  # no longer that target: the machine counts it lost
            try:
                self.machine.handle_alive(place[0], message["seq"], _now())
            except _callreg.RawError as refused:
                self.events.append(("alive_refused", address, str(refused.args[0].get("message"))))
            self.wake.set()

    async def _deadlines(self) -> None:
        """Calls the machine's timeout handling at its deadlines."""
        while True:
            deadline = self.machine.poll_timeout()
            self.wake.clear()
            delay = 1.0 if deadline is None else max(0.0, (deadline - _now()) / 1e6)
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=min(delay, 1.0))
            except asyncio.TimeoutError:
                pass
            deadline = self.machine.poll_timeout()
            if deadline is not None and deadline <= _now():
                self.machine.handle_timeout(_now())
                self._pump()
