"""The liveness pass's look at the roles (``controller/cluster/_liveness.py``), without a cluster:
the scheduler, the placement and the hand-overs are stand-ins that answer what a test sets, the
losses are the job's real :class:`~dask_train.controller.cluster._losses.Losses`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from _fake_engine import FakeEngine, Fault, _spec  # noqa: E402

from dask_train.controller._state import JobLog, JobState, Phase
from dask_train.controller.cluster._liveness import Liveness
from dask_train.controller.cluster._losses import Losses
from dask_train.policy._failure import Failure, FailureConfig
from dask_train.policy._placement import Roles
from dask_train.runtime._cluster_view import ClusterView

A, B = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1"


class _Scheduler:
    """The scheduler's answers: its workers now, and the events of each worker."""

    def __init__(self, workers: dict[str, dict[str, Any]],
                 events: dict[str, list[dict[str, Any]]]) -> None:
        self.workers, self.worker_events = workers, events
        self.identities = 0

    async def identity(self) -> dict[str, Any]:
        self.identities += 1
        return {"workers": dict(self.workers)}

    async def events(self, topic: str) -> list[tuple[float, dict[str, Any]]]:
        return [(0.0, e) for e in self.worker_events.get(topic, [])]


class _Client:
    def __init__(self, scheduler: _Scheduler) -> None:
        self.scheduler = scheduler


class _Placement:
    async def saw(self, view: ClusterView) -> None:
        pass


class _HandOvers:
    """No hand-over is under way; a lost worker's notice is not waited for."""

    awaiting = None

    def __init__(self) -> None:
        self.waited: list[set[str]] = []

    async def wait_for_notices(self, engine: FakeEngine, workers: set[str]) -> None:
        self.waited.append(set(workers))


class _Publisher:
    def publish(self, msg: dict[str, Any]) -> None:
        pass


def _liveness(client: _Client, *, max_failures: int) -> tuple[Liveness, JobLog, _HandOvers]:
    log, state = JobLog(), JobState()
    state.enter(Phase.RUNNING)
    losses = Losses(spec=_spec(failure=FailureConfig(max_failures=max_failures)), log=log,
                    state=state, publisher=_Publisher())  # type: ignore[arg-type]
    hand_overs = _HandOvers()
    liveness = Liveness(client, state=state, placement=_Placement(),  # type: ignore[arg-type]
                        losses=losses, hand_overs=hand_overs,  # type: ignore[arg-type]
                        wanted=None,  # type: ignore[arg-type]
                        manifest=lambda ledger, rng: {}, has_checkpoint=lambda: False)
    return liveness, log, hand_overs


def test_a_retired_worker_the_passs_older_view_still_lists_is_a_loss_with_notice() -> None:
    # The pass's view listed B, still retiring; the engine, waiting for a peer's death to
    # show, looked again and found B gone. The scheduler's events say B was retired.
    scheduler = _Scheduler({A: {"nthreads": 1, "status": "running"}},
                           {B: [{"action": "retired"}]})
    liveness, log, hand_overs = _liveness(_Client(scheduler), max_failures=0)
    lost = Failure("trainer", 1, B, f"the Dask worker {B} left the cluster")
    engine = FakeEngine(faults=[Fault(lost)])
    engine.roles = Roles({"trainer": [A, B]})
    older = ClusterView.of({A: {"nthreads": 1, "status": "running"},
                            B: {"nthreads": 1, "status": "closing_gracefully"}})

    restart = asyncio.run(liveness._check_roles(engine, older))

    # Not counted against max_failures=0 (it would have raised WorkerLost): a restart, from
    # the same state a crash would give, recorded as a departure with notice.
    assert restart is lost
    assert [(f["worker"], f["notice"], f["loss"], f["action"]) for f in log.failures] == \
        [(B, True, None, "restart")]
    assert scheduler.identities == 1  # one fresh look, as the failure named a listed worker
    assert hand_overs.waited == [{B}]  # its notice given its moment, as any lost worker's


def test_a_role_that_raised_on_a_listed_worker_is_decided_on_a_fresh_look_that_still_lists_it(
        ) -> None:
    # The scorer raised on A, which is alive: one fresh look, and A is no lost worker.
    scheduler = _Scheduler({A: {"nthreads": 1, "status": "running"}}, {})
    liveness, log, hand_overs = _liveness(_Client(scheduler), max_failures=3)
    failed = Failure("scorer", 0, A, "the scorer raised")
    engine = FakeEngine(faults=[Fault(failed)])
    engine.roles = Roles({"trainer": [A], "scorer": [A]})
    view = ClusterView.of({A: {"nthreads": 1, "status": "running"}})

    asyncio.run(liveness._check_roles(engine, view))

    assert scheduler.identities == 1
    assert hand_overs.waited == []  # no worker left: no notice to wait for
    assert [(f["worker"], f["notice"], f["loss"]) for f in log.failures] == [(A, False, 1)]


def test_a_failure_of_a_worker_the_view_no_longer_lists_needs_no_second_look() -> None:
    scheduler = _Scheduler({A: {"nthreads": 1, "status": "running"}}, {})
    liveness, log, _ = _liveness(_Client(scheduler), max_failures=3)
    lost = Failure("trainer", 1, B, f"the Dask worker {B} left the cluster")
    engine = FakeEngine(faults=[Fault(lost)])
    engine.roles = Roles({"trainer": [A, B]})
    view = ClusterView.of({A: {"nthreads": 1, "status": "running"}})

    assert asyncio.run(liveness._check_roles(engine, view)) is lost
    assert scheduler.identities == 0
    assert [(f["worker"], f["notice"], f["loss"]) for f in log.failures] == [(B, False, 1)]


class _Listings(_Scheduler):
    """A scheduler whose listing changes between looks: each look takes the next one."""

    def __init__(self, listings: list[dict[str, dict[str, Any]]]) -> None:
        super().__init__(listings[0], {})
        self.listings = listings

    async def identity(self) -> dict[str, Any]:
        self.workers = self.listings[min(self.identities, len(self.listings) - 1)]
        return await super().identity()


def test_a_stop_takes_a_worker_an_engines_second_look_found_gone_for_a_loss() -> None:
    # As the job stops, the engine (waiting for a peer's death to show) found B gone, while
    # the scheduler's first listing still had it: a fresh look makes it a loss, not the job's
    # own error with every worker alive.
    running = {"nthreads": 1, "status": "running"}
    scheduler = _Listings([{A: running, B: running}, {A: running}])
    liveness, _, _ = _liveness(_Client(scheduler), max_failures=3)
    gone = Failure("trainer", 1, B, f"the Dask worker {B} left the cluster")
    engine = FakeEngine(faults=[Fault(gone)])
    engine.roles = Roles({"trainer": [A, B]})

    lost, alive = asyncio.run(liveness.losses.lost(_Client(scheduler), engine))  # type: ignore[arg-type]

    assert lost == [gone]
    assert set(alive) == {A}
    assert scheduler.identities == 2


def test_a_stop_with_every_failed_roles_worker_listed_twice_finds_no_loss() -> None:
    running = {"nthreads": 1, "status": "running"}
    scheduler = _Listings([{A: running, B: running}])
    liveness, _, _ = _liveness(_Client(scheduler), max_failures=3)
    engine = FakeEngine(faults=[Fault(Failure("scorer", 0, B, "the scorer raised"))])
    engine.roles = Roles({"trainer": [A], "scorer": [B]})

    lost, _ = asyncio.run(liveness.losses.lost(_Client(scheduler), engine))  # type: ignore[arg-type]

    assert lost == []
    assert scheduler.identities == 2
