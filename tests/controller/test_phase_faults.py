"""The controller's phases when a role is lost while a generation starts (see test_phases.py for
the scripted engine and the real in-process cluster these tests run on)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _fake_engine import (  # noqa: E402
    FD,
    RS,
    E,
    ElasticFakeEngine,
    F,
    FakeEngine,
    Fault,
    R,
    S,
    _earlier_checkpoint,
    _ok,
    _run,
    _spec,
)
from distributed import Client

from dask_train.checkpoint import CheckpointConfig
from dask_train.engines._events import Epochs, Progress
from dask_train.errors import TrainingTimeout, WorkerLost
from dask_train.policy._failure import Failure, FailureConfig


def _lost_rank() -> tuple[Failure, WorkerLost]:
    address = "tcp://10.0.0.8:4000"
    return (Failure("trainer", 1, address, "removed from the scheduler"),
            WorkerLost(f"rank 1's worker {address} left the cluster while the ranks tried to "
                       "join the torch group", worker=address, role="trainer-1"))


def test_a_rank_lost_while_the_generation_starts_restarts_it() -> None:
    # A second loss while the job restarts: the new generation's group cannot form. It is a
    # loss like one while running, and the next generation starts.
    failure, error = _lost_rank()
    first = FakeEngine(start_error=error, faults=[Fault(failure)])
    second = FakeEngine([(0.0, Progress(step=2)), (0.05, Epochs(completed=1))], ends_at=0.1)
    outcome = _ok(run := _run([first, second], _spec()))

    assert run.phases == [S, RS, S, R, F, FD]
    assert first.calls == ["start", "close"]
    [lost] = outcome.log.failures
    assert (lost["role"], lost["action"], lost["generation"]) == ("trainer-1", "restart", 0)
    assert outcome.log.generations == 2 and outcome.stopped_by == "epochs=1"
    assert run.kinds.index("failure") < run.kinds.index("generation")


def test_a_start_failed_by_a_loss_the_scheduler_has_not_seen_yet_restarts() -> None:
    # A worker killed as the ranks are placed: their probe's connection closes before the
    # scheduler removes the worker (a chaos test's second kill). The controller asks again
    # until the loss shows, and restarts; it once raised the placement's error at once.
    failure, error = _lost_rank()
    first = FakeEngine(start_error=error, faults=[Fault(failure, at=0.6)])
    second = FakeEngine([(0.0, Progress(step=2)), (0.05, Epochs(completed=1))], ends_at=0.1)
    outcome = _ok(_run([first, second], _spec()))

    [lost] = outcome.log.failures
    assert (lost["role"], lost["action"]) == ("trainer-1", "restart")
    assert outcome.log.generations == 2 and outcome.stopped_by == "epochs=1"


@pytest.mark.parametrize("error", [
    ValueError("the model's forward raised"),
    TrainingTimeout("rank 1 on tcp://10.0.0.8:4000 did not finish within 30 s"),
], ids=["users-error", "timeout"])
def test_a_start_failed_by_another_error_raises_it_at_once(error: Exception) -> None:
    # Not a lost worker's error (a timeout is an OSError too, but the scheduler had the whole
    # timeout to see a loss): no wait for one. Had the controller waited, the loss reported
    # 0.6 s later would have restarted the job instead.
    failure, _ = _lost_rank()
    first = FakeEngine(start_error=error, faults=[Fault(failure, at=0.6)])
    run = _run([first], _spec())

    assert run.error is error and first.calls == ["start", "close"]


def test_a_rank_lost_while_starting_beyond_max_failures_raises_naming_it() -> None:
    failure, error = _lost_rank()
    first = FakeEngine(start_error=error, faults=[Fault(failure)])
    run = _run([first], _spec(failure=FailureConfig(max_failures=0)))

    assert isinstance(run.error, WorkerLost)
    assert (run.error.role, run.error.worker) == ("trainer-1", failure.worker)
    assert "failure 1 is more than max_failures=0" in str(run.error)
    assert run.phases == [S, E]


def test_a_lost_worker_counts_once_whatever_roles_it_held() -> None:
    # One worker held a trainer and the scorer: one loss against max_failures=1, not two.
    # A scorer raising on another worker in the same pass is a loss of its own.
    lost, other = "tcp://10.0.0.6:4000", "tcp://10.0.0.7:4000"
    faults = [Fault(Failure("trainer", 1, lost, "removed from the scheduler")),
              Fault(Failure("scorer", 0, lost, "removed from the scheduler"))]
    engine = ElasticFakeEngine([(0.0, Progress(step=4)), (0.05, Epochs(completed=1))],
                               ends_at=0.1, faults=faults)
    spec = _spec(strategy="async-ps", failure=FailureConfig(max_failures=1))
    outcome = _ok(_run([engine], spec, roles={"ps": 1, "trainer": 2, "scorer": 1}))
    assert [(f["role"], f["action"], f["loss"]) for f in outcome.log.failures] == \
        [("trainer-1", "continue", 1), ("scorer-0", "replace", 1)]

    faults.append(Fault(Failure("scorer", 0, other, "the scorer raised ValueError: boom")))
    engine = ElasticFakeEngine([(0.0, Progress(step=4))], ends_at=5.0, faults=faults)
    run = _run([engine], spec, roles={"ps": 1, "trainer": 2, "scorer": 1})
    assert isinstance(run.error, WorkerLost) and run.error.worker == other
    assert "failure 2 is more than max_failures=1" in str(run.error)


def test_a_server_and_a_trainer_lost_in_one_pass_are_both_recorded() -> None:
    # Two hosts died together (the server's first in the pass): the server's loss restarts
    # the job, and the trainer's is still a failure of its own, counted against max_failures.
    faults = [Fault(Failure("ps", 0, "tcp://10.0.0.3:4000", "removed from the scheduler")),
              Fault(Failure("trainer", 1, "tcp://10.0.0.6:4000", "removed from the scheduler"))]
    first = ElasticFakeEngine([(0.0, Progress(step=4))], ends_at=5.0, faults=faults)
    second = ElasticFakeEngine([(0.0, Progress(step=5)), (0.05, Epochs(completed=1))],
                               ends_at=0.1)
    roles = {"ps": 1, "trainer": 2}
    outcome = _ok(_run([first, second], _spec(strategy="async-ps"), roles=roles))
    assert [(f["role"], f["action"], f["loss"]) for f in outcome.log.failures] == \
        [("ps-0", "restart", 1), ("trainer-1", "continue", 2)]
    assert outcome.log.generations == 2

    first = ElasticFakeEngine([(0.0, Progress(step=4))], ends_at=5.0, faults=faults)
    run = _run([first], _spec(strategy="async-ps", failure=FailureConfig(max_failures=1)),
               roles=roles)
    assert isinstance(run.error, WorkerLost) and run.error.role == "trainer-1"
    assert "failure 2 is more than max_failures=1" in str(run.error)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_restart_says_how_many_samples_are_trained_again(tmp_path: Path,
                                                            checkpoint: bool) -> None:
    # The lost generation's ledger had 40 samples applied; a checkpoint (resumed) held 10 of
    # them, the initial state none: the rest are trained again, and the failure says how many.
    config = CheckpointConfig(tmp_path, every_seconds=None) if checkpoint else None
    if config is not None:
        _earlier_checkpoint(config, step=1)  # 10 samples
    lost = Failure("trainer", 0, "tcp://10.0.0.4:4000", "removed from the scheduler")
    first = FakeEngine([(0.0, Progress(step=4))], faults=[Fault(lost, at=0.1)])
    second = FakeEngine([(0.0, Progress(step=5)), (0.05, Epochs(completed=1))], ends_at=0.1)
    run = _run([first, second], _spec(checkpoint=config), resume=checkpoint)
    outcome = _ok(run)

    redone = 30 if checkpoint else 40
    assert [(f["action"], f["redone"]) for f in outcome.log.failures] == [("restart", redone)]
    assert run.published[run.kinds.index("generation")]["redone"] == redone


def test_a_server_lost_while_the_roles_stop_restarts_and_the_next_generation_finishes(
        tmp_path: Path) -> None:
    # The stop's engine call fails on a lost parameter server: the final parameters are gone
    # with it. The stop is withdrawn and a new generation trains to the job's end.
    lost = Failure("ps", 0, "tcp://10.0.0.3:4000", "removed from the scheduler")
    error = WorkerLost("pulling the final parameters: parameter holder 0's worker left",
                       worker=lost.worker, role="ps-0")
    first = ElasticFakeEngine([(0.0, Progress(step=2)), (0.02, Epochs(completed=1))],
                              ends_at=0.05, stop_error=error,
                              faults=[Fault(lost, stopping=True)])
    second = ElasticFakeEngine([(0.0, Progress(step=3)), (0.05, Epochs(completed=1))],
                               ends_at=0.1)
    outcome = _ok(run := _run([first, second], _spec(strategy="async-ps"),
                              roles={"ps": 1, "trainer": 1}))

    assert run.phases == [S, R, F, RS, S, R, F, FD]
    assert first.calls == ["start", "stop None", "close"]
    assert [(f["role"], f["action"]) for f in outcome.log.failures] == [("ps-0", "restart")]
    assert outcome.log.generations == 2 and outcome.stopped_by == "epochs=1"


def test_a_scorer_lost_while_the_roles_stop_is_replaced_and_the_job_stops() -> None:
    lost = Failure("scorer", 0, "tcp://10.0.0.5:4000", "removed from the scheduler")
    error = WorkerLost("the final score: scorer-0's worker left", worker=lost.worker,
                       role="scorer-0")
    engine = ElasticFakeEngine([(0.0, Progress(step=2)), (0.02, Epochs(completed=1))],
                               ends_at=0.05, stop_error=error,
                               faults=[Fault(lost, stopping=True)])
    outcome = _ok(run := _run([engine], _spec(strategy="async-ps"),
                              roles={"ps": 1, "trainer": 1, "scorer": 1}))

    assert run.phases == [S, R, F, FD]
    assert engine.calls == ["start", "stop None", "replace scorer on 1 worker(s)", "stop None",
                            "close"]
    assert [(f["role"], f["action"]) for f in outcome.log.failures] == [("scorer-0", "replace")]
    assert outcome.stopped_by == "epochs=1"


def test_a_worker_that_left_with_notice_as_the_generation_started_is_not_counted() -> None:
    # `dask worker --lifetime` workers: one ends its lifetime while a generation's ranks are
    # placed on it (no hand-over is made while a job starts). Acted on as a loss, from the
    # same state; recorded with its notice, and max_failures (0 here) does not count it: a
    # long job on such workers would otherwise fail after a few unlucky moments.
    failure, error = _lost_rank()
    first = FakeEngine(start_error=error, faults=[Fault(failure)], leaving=[failure.worker])
    second = FakeEngine([(0.0, Progress(step=2)), (0.05, Epochs(completed=1))], ends_at=0.1)
    outcome = _ok(_run([first, second], _spec(failure=FailureConfig(max_failures=0))))

    [lost] = outcome.log.failures
    assert (lost["role"], lost["action"], lost["notice"], lost["loss"]) == \
        ("trainer-1", "restart", True, None)
    assert outcome.log.generations == 2 and outcome.stopped_by == "epochs=1"


def test_a_worker_that_left_with_notice_as_the_job_stopped_is_not_counted() -> None:
    # The same while the job stops: the stop cannot gather the leaving rank's end, and the
    # job restarts from the survivors' state to stop again.
    failure, error = _lost_rank()
    first = FakeEngine([(0.0, Progress(step=2)), (0.02, Epochs(completed=1))], ends_at=0.05,
                       stop_error=error, faults=[Fault(failure, stopping=True)],
                       leaving=[failure.worker])
    second = FakeEngine([(0.0, Progress(step=3)), (0.02, Epochs(completed=1))], ends_at=0.05)
    outcome = _ok(_run([first, second], _spec(failure=FailureConfig(max_failures=0))))

    [lost] = outcome.log.failures
    assert (lost["role"], lost["notice"], lost["loss"]) == ("trainer-1", True, None)
    assert outcome.log.generations == 2


def test_a_worker_retired_before_its_role_ran_is_not_counted() -> None:
    # A `dask worker --lifetime` worker whose lifetime ends right after a generation's ranks
    # were placed on it: no role ran there yet, so it held nothing, told no job, and left. The
    # scheduler's events say it was retired: recorded with its notice, not counted against
    # max_failures (0). It once counted as a crash (a CI run's dt.run on such workers).
    first = FakeEngine([(0.0, Progress(step=2))])
    second = FakeEngine([(0.0, Progress(step=3)), (0.05, Epochs(completed=1))], ends_at=0.1)

    async def retire(client: Client, address: str) -> None:
        first.faults = [Fault(Failure("trainer", 1, address, "removed from the scheduler"))]
        await client.retire_workers([address], close_workers=True)

    outcome = _ok(_run([first, second], _spec(failure=FailureConfig(max_failures=0)),
                       before=retire))

    [lost] = outcome.log.failures
    assert (lost["role"], lost["action"], lost["notice"], lost["loss"]) == \
        ("trainer-1", "restart", True, None)
    assert outcome.log.generations == 2 and outcome.stopped_by == "epochs=1"


def test_a_lost_worker_without_notice_still_counts() -> None:
    # The reference for the two above: the same loss without notice is over max_failures=0.
    failure, error = _lost_rank()
    first = FakeEngine(start_error=error, faults=[Fault(failure)])
    run = _run([first], _spec(failure=FailureConfig(max_failures=0)))

    assert "max_failures=0" in str(run.error)
