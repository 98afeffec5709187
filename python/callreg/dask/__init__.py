"""Many machines on Dask distributed (``specs/python.md`` §6): a
:class:`Cluster` registers a callable once on every Dask worker and runs
tasks that carry only its digest and their arguments.

* The registry lives on the Dask scheduler (a scheduler plugin) and is
  driven by callreg's own parent machine: every serving Dask worker is a
  target, Dask's comms are the transport. A register publishes only once
  every serving worker installed it, a failure rolls back, a worker that
  joins is given every live callable before it serves, one that leaves is
  a lost target, and one that does not answer in time is removed from the
  cluster (a fence).
* Each Dask worker hosts a callreg :class:`~callreg.Worker` (a worker
  plugin; ``start_method="forkserver"``, as a Dask worker runs threads),
  whose targets run the tasks.
* Tasks are Dask tasks: :meth:`Cluster.submit` returns a
  :class:`distributed.Future`, scheduled, retried and gathered by Dask.

Needs the ``distributed`` package (the ``dask`` extra: ``pip install './python[dask]'`` from a checkout)."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar, cast

import distributed

from callreg import _callreg
from callreg._callables import callable_name, check_registrable, default_metadata, merge_metadata, metadata_json
from callreg._envelope import pack
from callreg._errors import HandleError, LifecycleError
from callreg._handle import Handle, raw_handle
from callreg._options import (
    DEFAULT_CONTROL_TIMEOUT,
    DEFAULT_RESPAWN_BACKOFF,
    DEFAULT_RESPAWN_LIMIT,
    checked_int,
    checked_seconds,
)
from callreg._raw_errors import error
from callreg.dask._host import HOST_PLUGIN, _Host, _run, _run_all
from callreg.dask._registry import REGISTRY_PLUGIN, _Registry

__all__ = ["Cluster", "DEFAULT_MAX_WORKERS", "HOST_PLUGIN", "REGISTRY_PLUGIN"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

_GATHER_BATCH = 64
"""How many results :meth:`Cluster.map` gathers in one round trip."""

DEFAULT_MAX_WORKERS = 256
"""Target ids of the cluster-level machine: at most this many Dask
workers serve at once."""


class Cluster:
    """Callables registered once on every worker of a Dask cluster, run by
    digest (``specs/python.md`` §6).

    ``client`` is a connected synchronous :class:`distributed.Client`. Each
    Dask worker hosts a callreg :class:`~callreg.Worker` of
    ``targets_per_worker`` targets, built with ``worker_options`` (the
    Worker's keyword options; ``start_method`` defaults to
    ``"forkserver"``). ``max_workers`` Dask workers serve at once at most;
    ``control_timeout`` (seconds) bounds a worker's silence about a
    register (past it the worker is removed from the cluster; its Dask
    heartbeats count as alive reports, so an install may take up to 4 ×
    ``control_timeout``: keep it well above Dask's heartbeat interval,
    0.5–2 s), and
    ``probe_first``, ``respawn_limit`` and ``respawn_backoff`` are the
    cluster-level registry's, as a Worker's.

    The registry lives on the scheduler: the first Cluster of a scheduler
    creates it and the workers' callreg Workers with its options (the
    registry's and ``targets_per_worker`` and ``worker_options``); a later
    one (another client, or the same after a reconnect) uses them as they
    are. :meth:`close` ends the registry for every Cluster of the
    scheduler (theirs then raise :class:`~callreg.LifecycleError`).

    Raises ``TypeError`` unless ``client`` is a synchronous
    :class:`distributed.Client` or for an option of the wrong type,
    ``ValueError`` for an option out of range."""

    def __init__(
        self,
        client: distributed.Client,
        *,
        targets_per_worker: int = 1,
        max_workers: int = DEFAULT_MAX_WORKERS,
        control_timeout: float = DEFAULT_CONTROL_TIMEOUT,
        probe_first: bool = True,
        respawn_limit: int = DEFAULT_RESPAWN_LIMIT,
        respawn_backoff: float = DEFAULT_RESPAWN_BACKOFF,
        **worker_options: Any,
    ) -> None:
        if not isinstance(client, distributed.Client):
            raise TypeError("client must be a distributed.Client, not %s" % type(client).__name__)
        if client.asynchronous:
            raise TypeError("callreg.dask.Cluster needs a synchronous distributed.Client")
        targets_per_worker = checked_int("targets_per_worker", targets_per_worker, 1, 65535)
        max_workers = checked_int("max_workers", max_workers, 1, 65535)
        respawn_limit = checked_int("respawn_limit", respawn_limit, 0, 65535)
        control_timeout = checked_seconds("control_timeout", control_timeout, zero_ok=False)
        respawn_backoff = checked_seconds("respawn_backoff", respawn_backoff, zero_ok=True)
        if not isinstance(probe_first, bool):
            raise TypeError("probe_first must be a bool, not %s" % type(probe_first).__name__)
        # The Worker's own checks, here and now rather than on every worker.
        from callreg._worker import Worker

        Worker(targets_per_worker, **{"start_method": "forkserver", **worker_options}).close()
        self._client = client
        self._closed = False
        self._lock = threading.Lock()
        self._live: dict[int, Handle[..., Any]] = {}
        client.register_plugin(
            _Registry(
                max_workers=max_workers,
                control_timeout=control_timeout,
                probe_first=probe_first,
                respawn_limit=respawn_limit,
                respawn_backoff=respawn_backoff,
            ),
            name=REGISTRY_PLUGIN,
        )
        client.register_plugin(_Host(targets_per_worker, worker_options, control_timeout), name=HOST_PLUGIN)
        for text in self._state()["handles"]:
            handle = Handle._of(_callreg.RawHandle.from_json(text))
            self._live[handle._raw.handle_id] = handle

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        client: Any = self._client
        return "<callreg.dask.Cluster %s%s>" % (client.scheduler.address, " closed" if self._closed else "")

    def _scheduler(self, handler: str, **kwargs: Any) -> dict[str, Any]:
        """Calls the registry's ``handler`` on the scheduler and waits."""
        client: Any = self._client
        answer = client.sync(getattr(client.scheduler, handler), **kwargs)
        if not isinstance(answer, dict):
            # The scheduler knows no such handler: its registry was closed.
            raise LifecycleError(
                "this scheduler has no callreg registry: a Cluster on it was closed", code="LIFECYCLE_INVALID"
            )
        return answer

    def _state(self) -> dict[str, Any]:
        return self._scheduler("callreg_state")

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise LifecycleError("the Cluster is closed", code="LIFECYCLE_INVALID", operation=operation)

    def _answer(self, answer: dict[str, Any]) -> Handle[..., Any]:
        if "error" in answer:
            fields = answer["error"]
            fields.setdefault("operation", "register")
            raise error(_fields(fields))
        return Handle._of(_callreg.RawHandle.from_json(answer["handle"]))

    @property
    def workers(self) -> list[str]:
        """The addresses of the Dask workers that serve (joined), sorted."""
        self._check_open("workers")
        return list(self._state()["workers"])

    def handles(self) -> list[Handle[..., Any]]:
        """The registry's live handles (registered by any client), in
        handle order: a client that reconnected finds its callables here."""
        self._check_open("handles")
        handles = []
        for text in self._state()["handles"]:
            raw = _callreg.RawHandle.from_json(text)
            with self._lock:
                handle = self._live.setdefault(raw.handle_id, Handle._of(raw))
            handles.append(handle)
        return handles

    def wait_for_workers(self, n: int, timeout: float | None = None) -> list[str]:
        """Waits until at least ``n`` Dask workers serve (each joined: it
        holds every live callable) and returns their addresses. Raises
        :class:`TimeoutError` after ``timeout`` seconds."""
        self._check_open("wait_for_workers")
        deadline = None if timeout is None else time.monotonic() + timeout
        for pause in itertools.chain([0.0, 0.01, 0.02, 0.05], itertools.repeat(0.1)):
            workers = self.workers
            if len(workers) >= n:
                return workers
            if deadline is not None and time.monotonic() + pause > deadline:
                raise TimeoutError("%d of %d Dask workers serve after %s s" % (len(workers), n, timeout))
            time.sleep(pause)
        raise AssertionError("unreachable")

    def register(self, fn: Callable[_P, _R], *, metadata: Mapping[str, Any] | None = None) -> Handle[_P, _R]:
        """Registers ``fn`` on every serving Dask worker (its envelope
        crosses the network once per worker) and returns its handle once
        every one installed it, as :meth:`callreg.Worker.register` does
        over targets: a failure anywhere rolls it back everywhere
        (:class:`~callreg.RegisterError`, with each worker's target id and
        outcome), a callable that killed a worker's target is refused from
        then on (``REGISTER_POISONED``); ``NO_LIVE_TARGET`` while no
        worker serves."""
        self._check_open("register")
        check_registrable(fn, "register")
        envelope = pack(fn)
        meta = merge_metadata(default_metadata(callable_name(fn)), metadata)
        text = None if meta is None else metadata_json(meta)
        answer = self._scheduler("callreg_register", envelope=envelope, metadata=text)
        handle = self._answer(answer)
        with self._lock:
            self._live[handle._raw.handle_id] = handle
        return cast("Handle[_P, _R]", handle)

    def unregister(self, handle: Handle[..., Any]) -> None:
        """Unregisters ``handle`` on every serving Dask worker. Raises
        :class:`~callreg.HandleError` for a handle not live in this
        registry."""
        self._check_open("unregister")
        raw = raw_handle(handle)
        answer = self._scheduler("callreg_unregister", handle=raw.to_json())
        if "error" in answer:
            answer["error"].setdefault("operation", "unregister")
        self._answer(answer)
        with self._lock:
            self._live.pop(raw.handle_id, None)

    def _digest(self, handle: Handle[..., Any], operation: str) -> bytes:
        self._check_open(operation)
        raw = raw_handle(handle)
        with self._lock:
            known = self._live.get(raw.handle_id)
        if known is None:
            # Registered through another Cluster of this registry, perhaps.
            self.handles()
            with self._lock:
                known = self._live.get(raw.handle_id)
        if known is None or (known._raw is not raw and known._raw.to_json() != raw.to_json()):
            raise HandleError(
                "%r is not a live handle of this Cluster" % (handle,), code="HANDLE_STALE", operation=operation
            )
        return raw.digest

    def submit(self, handle: Handle[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> distributed.Future[_R]:
        """Runs ``handle(*args, **kwargs)`` as a Dask task on a serving
        worker (in a target of its callreg Worker) and returns its
        :class:`distributed.Future`; the task carries the 32-byte digest
        and the arguments (Dask futures among them are resolved first).
        Raises :class:`~callreg.HandleError` for a handle this Cluster
        does not know live."""
        digest = self._digest(handle, "submit")
        return self._client.submit(_run, digest, args, kwargs, pure=False, key="callreg-%s" % uuid.uuid4().hex)

    def call(self, handle: Handle[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        """:meth:`submit` and wait for the result (the task's exception is
        raised here as itself, as a Worker's)."""
        result: _R = self.submit(handle, *args, **kwargs).result()
        return result

    def map(self, handle: Handle[..., _R], /, *iterables: Iterable[Any]) -> Iterator[_R]:
        """``handle(*items)`` for each tuple of items, submitted at once as
        Dask tasks; an iterator of the results in order."""
        digest = self._digest(handle, "map")
        calls = list(zip(*iterables, strict=False))
        if not calls:
            return iter(())
        futures = self._client.map(
            _run, [digest] * len(calls), calls, [{}] * len(calls), pure=False, key="callreg-map-%s" % uuid.uuid4().hex
        )
        return self._in_order(futures)

    def _in_order(self, futures: list[Any]) -> Iterator[_R]:
        """The results of ``futures`` in order, gathered a batch at a time
        (one round trip per batch, not per result)."""
        for start in range(0, len(futures), _GATHER_BATCH):
            yield from cast(list[_R], cast(Any, self._client).gather(futures[start : start + _GATHER_BATCH]))

    def call_all(self, handle: Handle[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> dict[str, dict[int, _R]]:
        """Runs the task on every target of every serving worker:
        ``{worker address: {target id: result}}``."""
        digest = self._digest(handle, "call_all")
        workers = self.workers
        futures = {
            address: self._client.submit(
                _run_all,
                digest,
                args,
                kwargs,
                pure=False,
                workers=[address],
                allow_other_workers=False,
                key="callreg-all-%s" % uuid.uuid4().hex,
            )
            for address in workers
        }
        return {address: cast(dict[int, _R], f.result()) for address, f in futures.items()}

    def close(self) -> None:
        """Ends the registry: every Dask worker closes its callreg Worker
        (its targets exit) and the scheduler drops the registry. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # The registry first (no frame goes to a host being torn down), then
        # the hosts, then the plugin itself.
        try:
            self._scheduler("callreg_close")
        except LifecycleError:
            pass  # closed already (by another Cluster)
        try:
            cast(Any, self._client).unregister_worker_plugin(HOST_PLUGIN)
        except (ValueError, KeyError):
            pass
        try:
            self._client.unregister_scheduler_plugin(REGISTRY_PLUGIN)
        except (ValueError, KeyError):
            pass


def _fields(fields: dict[str, Any]) -> Any:
    """A registry error's fields in the form the package's error mapping
    takes (every key a Worker's error has)."""
    full: dict[str, Any] = {
        "code": "IO_FAILED",
        "operation": "register",
        "target": None,
        "hashid": None,
        "seq": None,
        "message": "",
        "full": None,
        "kind": "",
        "exception": None,
        "outcomes": [],
    }
    full.update(fields)
    if full["full"] is None:
        full["full"] = full["message"]
    full["outcomes"] = [tuple(o) for o in full["outcomes"]]
    return full
