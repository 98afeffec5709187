"""callreg.dask.Cluster on a real distributed.LocalCluster (worker
processes under nannies, loopback only): register once per Dask worker,
tasks by digest, joins, kills, poison, unregister, reconnects and close."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

distributed = pytest.importorskip("distributed")
psutil = pytest.importorskip("psutil")

import callreg  # noqa: E402
from callreg.dask import HOST_PLUGIN, Cluster  # noqa: E402

WAIT = 60.0


@pytest.fixture(scope="module", autouse=True)
def resource_tracker() -> None:
    """The interpreter's multiprocessing resource tracker, which Dask's
    nannies start at their first spawn and which lives as long as this
    process: started before any test so that the check that a test leaves
    no child process sees it as already there."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def local_cluster(n_workers: int) -> Any:
    return distributed.LocalCluster(
        n_workers=n_workers,
        threads_per_worker=2,
        processes=True,
        host="127.0.0.1",
        dashboard_address="127.0.0.1:0",
        silence_logs=logging.CRITICAL,
    )


@pytest.fixture
def two() -> Iterator[tuple[Any, Any]]:
    with local_cluster(2) as lc, distributed.Client(lc) as client:
        yield lc, client


def worker_pids(client: Any) -> dict[str, int]:
    return dict(client.run(os.getpid))


def host_incarnations(client: Any) -> dict[str, int]:
    """Each Dask worker's sum of its callreg targets' incarnations (how
    many of its targets were replaced)."""

    def incarnations(dask_worker: Any) -> int:
        local = dask_worker.plugins[HOST_PLUGIN].local
        return sum(local.target_incarnation(t) for t in range(len(local.targets)))

    return dict(client.run(incarnations))


def test_register_and_call_on_two_workers_of_two_targets(two: tuple[Any, Any]) -> None:
    lc, client = two
    with Cluster(client, targets_per_worker=2) as cluster:
        workers = cluster.wait_for_workers(2, timeout=WAIT)
        assert sorted(workers) == sorted(lc.workers[i].worker_address for i in lc.workers)
        k = 7

        def times_k(x: int) -> tuple[int, int]:
            return os.getpid(), x * k

        h = cluster.register(times_k)
        assert h.hashid == callreg.hashid(times_k)
        assert cluster.call(h, 6)[1] == 42
        everywhere = cluster.call_all(h, 1)
        assert sorted(everywhere) == sorted(workers)
        assert all(sorted(per) == [0, 1] for per in everywhere.values())
        pids = [pid for per in everywhere.values() for pid, _ in per.values()]
        assert len(set(pids)) == 4
        assert not set(pids) & set(worker_pids(client).values())
        assert [r for _, r in cluster.map(h, range(5))] == [0, 7, 14, 21, 28]
        futures = [cluster.submit(h, x) for x in range(10)]
        assert all(isinstance(f, distributed.Future) for f in futures)
        assert [r for _, r in client.gather(futures)] == [x * 7 for x in range(10)]
        done = {f.key for f in distributed.as_completed(futures)}
        assert done == {f.key for f in futures}
        # A task's argument may be a Dask future: resolved first.
        assert cluster.call(h, client.submit(lambda: 3, pure=False))[1] == 21
        # A task's exception is raised here as itself.

        def div(a: int, b: int) -> float:
            return a / b

        d = cluster.register(div)
        with pytest.raises(ZeroDivisionError):
            cluster.call(d, 1, 0)
        assert [x.hashid for x in cluster.handles()] == [h.hashid, d.hashid]


def test_a_worker_that_joins_is_given_every_live_callable_before_it_serves(two: tuple[Any, Any]) -> None:
    lc, client = two
    with Cluster(client) as cluster:
        cluster.wait_for_workers(2, timeout=WAIT)
        h1 = cluster.register(lambda: "one")
        h2 = cluster.register(lambda x: x + 1)
        lc.scale(3)
        workers = cluster.wait_for_workers(3, timeout=WAIT)
        assert len(workers) == 3
        assert cluster.call_all(h1) == {w: {0: "one"} for w in workers}
        assert cluster.call_all(h2, 1) == {w: {0: 2} for w in workers}


def test_a_worker_killed_during_registers_and_tasks_publishes_nothing_partially(two: tuple[Any, Any]) -> None:
    lc, client = two
    with Cluster(client) as cluster:
        cluster.wait_for_workers(2, timeout=WAIT)

        def slow(x: int) -> int:
            time.sleep(0.05)
            return x * x

        h = cluster.register(slow)
        futures = [cluster.submit(h, x) for x in range(60)]
        outcomes: list[tuple[int, str, Any]] = []

        def registers() -> None:
            for i in range(30):
                fn = lambda i=i: i  # noqa: E731
                try:
                    outcomes.append((i, callreg.hashid(fn), cluster.register(fn)))
                except callreg.CallregError as e:
                    outcomes.append((i, callreg.hashid(fn), e))

        thread = threading.Thread(target=registers)
        thread.start()
        time.sleep(0.3)
        victim, pid = sorted(worker_pids(client).items())[0]
        os.kill(pid, signal.SIGKILL)
        thread.join(WAIT)
        assert not thread.is_alive()
        # Dask reschedules the lost worker's tasks: every one succeeds.
        assert client.gather(futures) == [x * x for x in range(60)]
        workers = cluster.wait_for_workers(2, timeout=WAIT)
        assert victim not in workers
        live = {x.hashid for x in cluster.handles()}
        published = [(i, r) for i, _, r in outcomes if isinstance(r, callreg.Handle)]
        failed = [(hashid, r) for _, hashid, r in outcomes if not isinstance(r, callreg.Handle)]
        assert len(outcomes) == 30 and published
        for hashid, error in failed:
            assert isinstance(error, callreg.RegisterError), error
            assert error.code == "REGISTER_PARTIAL_FAILURE", error
            # Nothing of a failed register is live.
            assert hashid not in live
        # Every published callable is on every serving worker, the
        # restarted one included.
        for i, handle in published:
            assert handle.hashid in live
            assert cluster.call_all(handle) == {w: {0: i} for w in workers}


def test_a_poison_callable_costs_one_target_and_is_refused_with_every_dask_worker_alive(
    two: tuple[Any, Any],
) -> None:
    lc, client = two
    with Cluster(client) as cluster:
        cluster.wait_for_workers(2, timeout=WAIT)
        before = worker_pids(client)

        class Boom:
            def __reduce__(self) -> tuple[Any, ...]:
                return (os._exit, (3,))

        boom = Boom()

        def poison() -> object:
            return boom

        with pytest.raises(callreg.RegisterError) as first:
            cluster.register(poison)
        assert first.value.code == "REGISTER_POISONED", str(first.value)
        assert "exited with status 3" in str(first.value)
        with pytest.raises(callreg.RegisterError) as again:
            cluster.register(poison)
        assert again.value.code == "REGISTER_POISONED"
        # Every Dask worker lives on; one target of one of them was lost
        # (and replaced).
        assert worker_pids(client) == before
        deadline = time.monotonic() + WAIT
        while sorted(host_incarnations(client).values()) != [0, 1]:
            assert time.monotonic() < deadline, host_incarnations(client)
            time.sleep(0.05)
        h = cluster.register(lambda: "fine")
        assert list(cluster.call_all(h).values()) == [{0: "fine"}, {0: "fine"}]


def test_a_worker_silent_past_the_control_timeout_is_fenced_out_of_the_cluster(two: tuple[Any, Any]) -> None:
    lc, client = two
    with Cluster(client, control_timeout=2.0) as cluster:
        cluster.wait_for_workers(2, timeout=WAIT)
        victim, pid = sorted(worker_pids(client).items())[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(callreg.RegisterError) as e:
                cluster.register(lambda: 1)
            assert time.monotonic() - started < WAIT
            assert e.value.code == "REGISTER_PARTIAL_FAILURE", str(e.value)
            assert "fenced" in str(e.value)
            # The registry had the scheduler remove the silent worker.
            assert victim not in cluster.workers
            deadline = time.monotonic() + WAIT
            while victim in client.scheduler_info()["workers"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert cluster.handles() == []
        finally:
            os.kill(pid, signal.SIGCONT)
        # The other worker serves on (and the fenced one, if its nanny
        # restarted it, serves again only after it arrived anew).
        h = cluster.register(lambda: 2)
        served = cluster.call_all(h)
        assert served and all(per == {0: 2} for per in served.values())


class SlowToInstall:
    """Unpickles (in a target) into a function returning ``"slow"`` after
    sleeping 3.5 s: only builtins travel, so no worker needs this module."""

    def __call__(self) -> str:
        return "slow"

    def __reduce__(self) -> tuple[Any, ...]:
        return (eval, ("__import__('time').sleep(3.5) or (lambda: 'slow')",))


def test_an_install_longer_than_the_control_timeout_is_bounded_by_the_operation_timeout(
    two: tuple[Any, Any],
) -> None:
    # The workers' Dask heartbeats are their alive reports while they
    # install (specs/protocol.md §2.7): 3.5 s of unpickling each, against a
    # 1.5 s control timeout and a 6 s bound (Dask heartbeats every 0.5-1 s).
    lc, client = two
    with Cluster(client, control_timeout=1.5) as cluster:
        cluster.wait_for_workers(2, timeout=WAIT)
        before = sorted(cluster.workers)
        h = cluster.register(SlowToInstall())
        assert sorted(cluster.workers) == before
        assert list(cluster.call_all(h).values()) == [{0: "slow"}, {0: "slow"}]


def test_an_unregistered_callable_is_refused(two: tuple[Any, Any]) -> None:
    lc, client = two
    with Cluster(client) as cluster, Cluster(client) as other:
        cluster.wait_for_workers(2, timeout=WAIT)
        h = cluster.register(lambda: 1)
        [seen] = other.handles()
        assert seen.hashid == h.hashid
        cluster.unregister(h)
        with pytest.raises(callreg.HandleError) as here:
            cluster.call(h)
        assert here.value.code == "HANDLE_STALE"
        # A Cluster that still thinks it live: the Dask worker refuses it.
        with pytest.raises(callreg.HandleError) as there:
            other.call(seen)
        assert there.value.code == "HANDLE_STALE"
        with pytest.raises(callreg.HandleError) as twice:
            cluster.unregister(h)
        assert twice.value.code == "HANDLE_STALE"
        # A handle registered through another Cluster of the registry serves.
        theirs = other.register(lambda: "theirs")
        assert cluster.call(theirs) == "theirs"


def test_closing_a_cluster_ends_the_registry_for_every_cluster_of_the_scheduler(two: tuple[Any, Any]) -> None:
    lc, client = two
    first, second = Cluster(client), Cluster(client)
    first.wait_for_workers(2, timeout=WAIT)
    h = second.register(len)
    first.close()
    with pytest.raises(callreg.LifecycleError, match="the Cluster is closed"):
        first.handles()
    with pytest.raises(callreg.LifecycleError, match="this scheduler has no callreg registry"):
        second.register(abs)
    with pytest.raises(callreg.LifecycleError, match="this scheduler has no callreg registry"):
        second.wait_for_workers(1, timeout=1)
    with pytest.raises(callreg.LifecycleError, match="hosts no callreg Worker"):
        second.call(h, "abc")
    second.close()
    # A new Cluster starts a registry of its own.
    with Cluster(client) as third:
        third.wait_for_workers(2, timeout=WAIT)
        assert third.handles() == []
        assert third.call(third.register(len), "abcd") == 4


def test_the_registry_outlives_a_client_and_serves_a_worker_that_joins_meanwhile() -> None:
    with local_cluster(1) as lc:
        with distributed.Client(lc) as first:
            cluster = Cluster(first)
            cluster.wait_for_workers(1, timeout=WAIT)
            h = cluster.register(lambda x: -x)
        # No client is connected while a worker joins.
        lc.scale(2)
        with distributed.Client(lc) as second, Cluster(second) as again:
            workers = again.wait_for_workers(2, timeout=WAIT)
            [found] = again.handles()
            assert found.hashid == h.hashid
            assert again.call_all(found, 5) == {w: {0: -5} for w in workers}


def test_close_leaves_no_process() -> None:
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    with local_cluster(2) as lc, distributed.Client(lc) as client:
        cluster = Cluster(client, targets_per_worker=2)
        cluster.wait_for_workers(2, timeout=WAIT)
        h = cluster.register(os.getpid)
        targets = [pid for per in cluster.call_all(h).values() for pid in per.values()]
        hosts = list(worker_pids(client).values())
        helpers = {
            p.pid for host in hosts for p in psutil.Process(host).children(recursive=True) if p.pid not in targets
        }
        assert len(targets) == 4 and helpers, "each host has its template process"
        cluster.close()
        cluster.close()
        deadline = time.monotonic() + WAIT
        while any(psutil.pid_exists(p) for p in targets + sorted(helpers)):
            assert time.monotonic() < deadline, [p for p in targets + sorted(helpers) if psutil.pid_exists(p)]
            time.sleep(0.05)
        with pytest.raises(callreg.LifecycleError):
            cluster.register(len)
    deadline = time.monotonic() + WAIT
    while {p.pid for p in me.children(recursive=True)} - before:
        assert time.monotonic() < deadline, me.children(recursive=True)
        time.sleep(0.05)


def test_with_no_serving_worker_a_register_fails_no_live_target() -> None:
    with local_cluster(0) as lc, distributed.Client(lc) as client, Cluster(client) as cluster:
        assert cluster.workers == []
        with pytest.raises(callreg.TargetLostError) as e:
            cluster.register(len)
        assert e.value.code == "NO_LIVE_TARGET"


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="client must be a distributed.Client, not str"):
        Cluster("tcp://127.0.0.1:8786")  # type: ignore[arg-type]
    with local_cluster(0) as lc, distributed.Client(lc) as client:
        with pytest.raises(ValueError, match="targets_per_worker must be an int from 1 to 65535, got 0"):
            Cluster(client, targets_per_worker=0)
        with pytest.raises(ValueError, match="max_workers must be an int from 1 to 65535, got 0"):
            Cluster(client, max_workers=0)
        with pytest.raises(TypeError):
            Cluster(client, no_such_option=1)
        with pytest.raises(ValueError, match="respawn_limit must be an int from 0 to 65535, got -1"):
            Cluster(client, respawn_limit=-1)
        with pytest.raises(TypeError, match="targets_per_worker must be an int, not bool"):
            Cluster(client, targets_per_worker=True)
        with pytest.raises(TypeError, match="respawn_backoff must be a number of seconds, not str"):
            Cluster(client, respawn_backoff="x")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="control_timeout must be positive and finite, got nan"):
            Cluster(client, control_timeout=float("nan"))
        with pytest.raises(TypeError, match="probe_first must be a bool, not str"):
            Cluster(client, probe_first="no")  # type: ignore[arg-type]
        with Cluster(client) as cluster:
            with pytest.raises(callreg.HandleError) as e:
                cluster.call("not a handle")  # type: ignore[arg-type]
            assert e.value.code == "HANDLE_FOREIGN"
            with pytest.raises(TypeError):
                cluster.register(42)  # type: ignore[arg-type]
