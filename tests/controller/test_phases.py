"""The controller's phases and stop decisions, driven by a scripted in-memory engine.

``FakeEngine`` implements the engine protocol in memory: it emits a scripted list of
events over time, reports scripted failures, answers pauses with a snapshot, writes small shard
files through the controller's checkpoint store and ends when told to. The controller is the real
one, on an asyncio loop, with a real in-process scheduler and worker (``LocalCluster(
processes=False)``): it asks the scheduler which workers are alive and publishes its events there,
and a cluster of one thread costs about 20 ms, so nothing of Dask is faked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _fake_engine import (  # noqa: E402
    FD,
    N_PARAMS,
    RS,
    C,
    E,
    ElasticFakeEngine,
    F,
    FakeEngine,
    Fault,
    R,
    S,
    _earlier_checkpoint,
    _manifest,
    _ok,
    _run,
    _score,
    _spec,
)

from dask_train.checkpoint import CheckpointConfig, CheckpointStore
from dask_train.controller._state import JobState
from dask_train.engines._events import Epochs, NonFinite, Progress, Score, Started
from dask_train.errors import InvalidInput, ParameterServerLost, TrainingTimeout, WorkerLost
from dask_train.policy._failure import Failure, FailureConfig
from dask_train.policy._placement import Roles
from dask_train.policy.callbacks import Callback, History
from dask_train.policy.stop import EarlyStopping, StopAfter, StopAtScore, StopAtStep


def test_a_score_past_the_threshold_stops_and_keeps_the_parameters_it_scored() -> None:
    engine = FakeEngine([(0.0, Started(trainer=-1)), (0.0, Progress(step=9)),
                         (0.02, _score(4, accuracy=0.5, loss=1.2)),
                         (0.04, _score(7, accuracy=0.95, loss=0.3)),
                         (2.0, _score(9, accuracy=0.99, loss=0.1))])
    run = _run([engine], _spec(stop=[StopAtScore("accuracy", 0.9)]))
    outcome = _ok(run)

    assert run.phases == [S, R, F, FD]
    assert outcome.stopped_by == "StopAtScore(accuracy>=0.9)"
    assert run.controller.state.stop_step == 7
    assert engine.calls == ["start", "stop 7", "close"]
    assert outcome.model_step == 7 and outcome.ending.steps == 9
    np.testing.assert_array_equal(outcome.ending.params, np.full(N_PARAMS, 7.0))
    records = outcome.log.records
    assert [(r["step"], r["samples"], r["epoch"], r["accuracy"], r["loss"]) for r in records] == \
        [(4, 100, 1.0, 0.5, 1.2), (7, 175, 1.75, 0.95, 0.3)]
    assert 0 < records[0]["time_s"] <= records[1]["time_s"] < 2.0
    assert records[1]["samples_per_s"] == (175 - 100) / (records[1]["time_s"] - records[0]["time_s"])
    assert outcome.log.generations == 1 and outcome.log.failures == []
    assert outcome.log.first_step_at is not None and outcome.log.stop_at is not None
    assert run.kinds == ["start", "record", "record", "end"]
    assert run.published[-1]["stopped_by"] == "StopAtScore(accuracy>=0.9)"


def test_stop_after_fires_on_time_without_any_score() -> None:
    engine = FakeEngine([(0.0, Started(trainer=-1)), (0.0, Progress(step=3))])
    run = _run([engine], _spec(stop=[StopAfter(0.3)]))
    outcome = _ok(run)

    assert run.phases == [S, R, F, FD]
    assert outcome.stopped_by == "StopAfter(0.3s)"
    assert outcome.log.stop_at is not None
    assert 0.3 <= outcome.log.stop_at - outcome.log.started < 2.0
    assert engine.calls == ["start", "stop None", "close"]
    assert outcome.model_step == 3 and outcome.log.records == []


def test_a_step_limit_reached_by_a_score_keeps_the_last_parameters() -> None:
    engine = FakeEngine([(0.0, Progress(step=10)), (0.02, _score(5, loss=0.9)),
                         (0.04, _score(10, loss=0.5))])
    run = _run([engine], _spec(stop=[StopAtStep(10)], epochs=3))
    outcome = _ok(run)

    assert outcome.stopped_by == "StopAtStep(10)"
    assert run.controller.state.stop_step is None  # a step limit is met exactly: no scored copy
    assert engine.calls == ["start", "stop None", "close"]
    assert outcome.model_step == 10
    np.testing.assert_array_equal(outcome.ending.params, np.full(N_PARAMS, -1.0))
    assert [r["step"] for r in outcome.log.records] == [5, 10]


def test_an_engine_that_ends_at_the_step_limit_is_stopped_by_it() -> None:
    # The servers refuse updates past max_step, so the trainers end there on their own.
    engine = FakeEngine([(0.0, Progress(step=10)), (0.02, Epochs(completed=1))], ends_at=0.05)
    run = _run([engine], _spec(stop=[StopAtStep(10), StopAfter(60)], epochs=3))
    outcome = _ok(run)

    assert run.phases == [S, R, F, FD]
    assert outcome.stopped_by == "StopAtStep(10)"
    assert outcome.epochs_completed == 1 and outcome.model_step == 10


def test_the_last_epoch_ends_the_job_and_the_final_score_closes_the_history(tmp_path: Path) -> None:
    history = History()
    engine = FakeEngine([(0.0, Progress(step=4)), (0.02, _score(4, loss=0.8)),
                         (0.04, Epochs(completed=1)), (0.06, Progress(step=8)),
                         (0.08, Epochs(completed=2))], ends_at=0.1, final_score={"loss": 0.25})
    spec = _spec(epochs=2, callbacks=[history], stop=[StopAfter(60)],
                 checkpoint=CheckpointConfig(tmp_path, every_seconds=None))
    run = _run([engine], spec)
    outcome = _ok(run)

    assert run.phases == [S, R, F, FD]
    assert outcome.stopped_by == "epochs=2"
    assert outcome.epochs_completed == 2
    assert history.epochs == [1, 2]
    assert [(r["step"], r["loss"], r["epoch"]) for r in outcome.log.records] == \
        [(4, 0.8, 1.0), (8, 0.25, 0.8)]  # the final score: 80 samples of the engine's count
    assert [r["step"] for r in history.records] == [4, 8]
    assert engine.calls == ["start", "stop None", "save ckpt-000000000008-000", "close"]
    [final] = outcome.log.checkpoints
    assert final["final"] is True and final["step"] == 8
    manifest = _manifest(final["directory"])
    assert (manifest["step"], manifest["generation"], manifest["samples"]) == (8, 0, 80)
    assert manifest["ledger"] == {"epochs": 2, "step": 8} and manifest["rng"] == {"0": "rng-end"}
    assert [r["step"] for r in manifest["records"]] == [4, 8]
    assert manifest["shards"] == ["shard-0.safetensors"]


def test_early_stopping_on_a_plateau_keeps_its_state_in_the_final_checkpoint(tmp_path: Path) -> None:
    losses = [1.0, 0.5, 0.6, 0.55, 0.1]
    script = [(0.0, Progress(step=50))] + \
        [(0.01 * (i + 1), _score(10 * (i + 1), loss=v)) for i, v in enumerate(losses)]
    script[-1] = (2.0, script[-1][1])  # the improvement comes too late
    engine = FakeEngine(script)
    spec = _spec(stop=[EarlyStopping("loss", patience=2)],
                 checkpoint=CheckpointConfig(tmp_path, every_seconds=None))
    outcome = _ok(_run([engine], spec))

    assert outcome.stopped_by == "EarlyStopping(loss, patience=2, min_delta=0)"
    assert engine.calls[:2] == ["start", "stop 40"]
    assert outcome.model_step == 40
    assert [r["loss"] for r in outcome.log.records] == [1.0, 0.5, 0.6, 0.55]
    manifest = _manifest(outcome.log.checkpoints[-1]["directory"])
    assert manifest["stop"] == [{"type": "EarlyStopping", "state": {"best": 0.5, "wait": 2}}]


class _StopAtStep20(Callback):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_score(self, record: Mapping[str, Any]) -> bool:
        self.seen.append(int(record["step"]))
        return bool(record["step"] >= 20)


def test_a_callback_returning_true_from_on_score_stops_the_job() -> None:
    callback = _StopAtStep20()
    engine = FakeEngine([(0.0, Progress(step=25)), (0.02, _score(10, loss=0.9)),
                         (0.04, _score(20, loss=0.8)), (2.0, _score(25, loss=0.7))])
    outcome = _ok(_run([engine], _spec(callbacks=[callback], stop=[StopAfter(60)])))

    assert outcome.stopped_by == "callback"
    assert callback.seen == [10, 20]
    assert engine.calls == ["start", "stop None", "close"]  # a callback keeps the last parameters
    assert outcome.model_step == 25
    assert [r["step"] for r in outcome.log.records] == [10, 20]


class _StopAfterFirstEpoch(Callback):
    def on_epoch_end(self, epoch: int, record: Mapping[str, Any] | None) -> bool:
        return epoch >= 1


def test_a_callback_returning_true_from_on_epoch_end_stops_the_job() -> None:
    engine = FakeEngine([(0.0, Progress(step=6)), (0.02, Epochs(completed=1))])
    outcome = _ok(_run([engine], _spec(epochs=5, callbacks=[_StopAfterFirstEpoch()])))

    assert outcome.stopped_by == "callback"
    assert outcome.epochs_completed == 1 and outcome.model_step == 6


# -- non-finite losses and scores ------------------------------------------------------------------
def test_a_nonfinite_loss_with_on_nan_stop_ends_the_job_without_a_checkpoint(tmp_path: Path) -> None:
    engine = FakeEngine([(0.0, Progress(step=12)), (0.02, _score(10, loss=0.7)),
                         (0.04, NonFinite(trainer=1, loss="nan", step=12, epoch=0, block=3)),
                         (2.0, _score(12, loss=0.6))], final_score={"loss": 0.6})
    spec = _spec(on_nan="stop", checkpoint=CheckpointConfig(tmp_path, every_seconds=None))
    run = _run([engine], spec)
    outcome = _ok(run)

    assert run.phases == [S, R, F, FD]
    assert outcome.stopped_by == "non-finite loss (nan) at step 12 on trainer-1"
    assert run.controller.state.nan_stop is True
    assert outcome.log.nonfinite == [{"role": "trainer-1", "step": 12, "loss": "nan", "epoch": 0,
                                      "block": 3}]
    assert "save" not in " ".join(engine.calls)  # the last good checkpoint stays the newest
    assert outcome.log.checkpoints == [] and CheckpointStore(spec.checkpoint).complete() == []
    assert "nonfinite" in run.kinds


def test_a_nonfinite_loss_with_on_nan_skip_is_logged_and_the_job_goes_on(tmp_path: Path) -> None:
    engine = FakeEngine([(0.0, Progress(step=12)),
                         (0.02, NonFinite(trainer=0, loss="inf", step=3)),
                         (0.04, _score(12, loss=0.6)), (0.06, Epochs(completed=1))], ends_at=0.08)
    spec = _spec(on_nan="skip", checkpoint=CheckpointConfig(tmp_path, every_seconds=None))
    outcome = _ok(_run([engine], spec))

    assert outcome.stopped_by == "epochs=1"
    assert outcome.log.nonfinite == [{"role": "trainer-0", "step": 3, "loss": "inf", "epoch": -1,
                                      "block": -1}]
    assert [r["step"] for r in outcome.log.records] == [12]
    assert [c["step"] for c in outcome.log.checkpoints] == [12]


def test_a_nonfinite_score_with_on_nan_stop_ends_the_job_and_stays_out_of_the_history() -> None:
    bad = Score(step=15, samples=150, metrics={"loss": math.nan, "accuracy": 0.5},
                nonfinite=["loss"])
    engine = FakeEngine([(0.0, Progress(step=15)), (0.02, _score(10, loss=0.9)), (0.04, bad)])
    outcome = _ok(_run([engine], _spec(on_nan="stop", stop=[StopAtScore("accuracy", 0.4)])))

    assert outcome.stopped_by == "non-finite score (loss) at step 15"
    assert [r["step"] for r in outcome.log.records] == [10]
    assert outcome.log.nonfinite == [{"role": "scorer", "step": 15, "metrics": ["loss"]}]
    assert engine.calls == ["start", "stop None", "close"]  # not the NaN score's parameters


def test_a_nonfinite_score_with_on_nan_skip_is_never_seen_by_the_stop_conditions() -> None:
    bad = Score(step=15, samples=150, metrics={"loss": math.nan}, nonfinite=["loss"])
    engine = FakeEngine([(0.0, Progress(step=20)), (0.02, _score(10, loss=0.9)), (0.04, bad),
                         (0.06, _score(20, loss=0.4))])
    outcome = _ok(_run([engine], _spec(on_nan="skip", stop=[EarlyStopping("loss", patience=1),
                                                            StopAtScore("loss", 0.5)])))

    # A NaN counted by EarlyStopping would have stopped the job at step 15.
    assert outcome.stopped_by == "StopAtScore(loss<=0.5)"
    assert [r["step"] for r in outcome.log.records] == [10, 20]
    assert outcome.log.nonfinite == [{"role": "scorer", "step": 15, "metrics": ["loss"]}]
    assert outcome.model_step == 20


# -- checkpoint pauses -----------------------------------------------------------------------------
def test_a_checkpoint_every_n_steps_pauses_saves_writes_the_manifest_and_resumes(
        tmp_path: Path) -> None:
    engine = FakeEngine([(0.0, Started(trainer=0)), (0.0, Progress(step=5)),
                         (0.3, Progress(step=8)), (0.32, _score(8, loss=0.4)),
                         (0.34, Epochs(completed=1))], ends_at=0.4, final_score={"loss": 0.3})
    spec = _spec(checkpoint=CheckpointConfig(tmp_path, every_seconds=None, every_steps=5))
    run = _run([engine], spec)
    outcome = _ok(run)

    assert run.phases == [S, R, C, R, F, FD]
    assert engine.calls == ["start", "pause 1", "snapshot 1", "exact_step",
                            "save ckpt-000000000005-000", "resume 1", "stop None",
                            "save ckpt-000000000008-000", "close"]
    periodic, final = outcome.log.checkpoints
    assert (periodic["step"], periodic.get("final"), final["step"], final["final"]) == \
        (5, None, 8, True)
    assert periodic["pause_s"] > 0  # the pause waited for one poll at least
    manifest = _manifest(periodic["directory"])
    assert (manifest["step"], manifest["samples"], manifest["generation"]) == (5, 50, 0)
    assert manifest["ledger"] == {"paused_at": 5} and manifest["rng"] == {"0": "rng-5"}
    assert manifest["records"] == [] and manifest["n_params"] == N_PARAMS
    assert manifest["files"] == [{"index": 0, "start": 0, "stop": N_PARAMS}]
    assert CheckpointStore(spec.checkpoint).complete() == [periodic["directory"],
                                                           final["directory"]]
    assert outcome.stopped_by == "epochs=1"


def test_a_checkpoint_on_time_skips_the_write_when_no_step_was_taken(tmp_path: Path) -> None:
    # Two seconds for a checkpoint every 0.2 s: the second pause comes well before the end even
    # on a loaded machine (with one second it once came after, in a full run beside others).
    engine = FakeEngine([(0.0, Progress(step=3))], ends_at=2.0, pause_polls=0)
    spec = _spec(checkpoint=CheckpointConfig(tmp_path, every_seconds=0.2))
    run = _run([engine], spec)
    outcome = _ok(run)

    calls = engine.calls
    assert calls[:6] == ["start", "pause 1", "snapshot 1", "exact_step",
                         "save ckpt-000000000003-000", "resume 1"]
    assert calls[6:10] == ["pause 2", "snapshot 2", "exact_step", "resume 2"]  # nothing new
    assert calls[-3:] == ["stop None", "save ckpt-000000000003-000", "close"]
    assert not any(c.startswith("save") for c in calls[6:-3])
    assert [(c["step"], c.get("final", False)) for c in outcome.log.checkpoints] == \
        [(3, False), (3, True)]
    assert outcome.stopped_by == "trainers ended"  # no epoch completed and no step limit
    assert run.phases[:6] == [S, R, C, R, C, R]


def test_a_stop_during_a_checkpoint_pause_finishes_from_the_pause(tmp_path: Path) -> None:
    engine = FakeEngine([(0.0, Progress(step=2)), (0.1, _score(2, accuracy=0.99))],
                        answers_pauses=0)
    spec = _spec(stop=[StopAtScore("accuracy", 0.9)],
                 checkpoint=CheckpointConfig(tmp_path, every_seconds=None, every_steps=1))
    run = _run([engine], spec)
    outcome = _ok(run)

    assert run.phases == [S, R, C, F, FD]
    # The pause is left to the engine's stop, which releases it (as the role engines do).
    assert engine.calls == ["start", "pause 1", "stop 2", "save ckpt-000000000002-000", "close"]
    assert outcome.stopped_by == "StopAtScore(accuracy>=0.9)" and outcome.model_step == 2


def test_trainers_that_never_pause_end_the_job_with_training_timeout(tmp_path: Path) -> None:
    engine = FakeEngine([(0.0, Progress(step=1))], answers_pauses=0)
    spec = _spec(timeout=0.3, checkpoint=CheckpointConfig(tmp_path, every_seconds=None,
                                                          every_steps=1))
    run = _run([engine], spec)

    assert isinstance(run.error, TrainingTimeout)
    assert "did not all pause for a checkpoint within timeout=0.3 s" in str(run.error)
    assert run.phases == [S, R, C, E]
    assert engine.calls == ["start", "pause 1", "close"]
    assert run.published[-1]["kind"] == "end"
    assert run.published[-1]["error"].startswith("TrainingTimeout: the trainers did not all pause")


def test_no_worker_is_adopted_while_the_trainers_are_paused(tmp_path: Path) -> None:
    """A trainer started during a checkpoint's pause never gets the pause request: workers that
    joined are adopted only while the job runs, never while it waits for the pauses."""
    # The pause takes 120 passes (over 1.2 s): the roles are looked at once a second, so at
    # least once during it; the job runs on past the next look, which adopts.
    engine = ElasticFakeEngine([(0.0, Progress(step=1))], ends_at=3.0, pause_polls=120)
    spec = _spec(strategy="async-ps", timeout=10.0,
                 checkpoint=CheckpointConfig(tmp_path, every_seconds=None, every_steps=1))
    _ok(_run([engine], spec))

    assert "snapshot 1" in engine.calls
    assert engine.adoptions > 0 and engine.adopted_while_paused == 0


# -- failures and generations ----------------------------------------------------------------------
def test_a_rank_lost_during_a_pause_restarts_a_new_generation_from_the_checkpoint(
        tmp_path: Path) -> None:
    lost = Failure("trainer", 0, "tcp://10.0.0.9:4000", "removed from the scheduler")
    first = FakeEngine([(0.0, Progress(step=1)), (0.5, Progress(step=2))], answers_pauses=1,
                       faults=[Fault(lost, at=0.3, after_saves=1)])
    second = FakeEngine([(0.0, Started(trainer=0)), (0.05, Progress(step=3)),
                         (0.1, _score(3, loss=0.2)), (0.15, Epochs(completed=1))], ends_at=0.3,
                        pause_polls=0)
    spec = _spec(checkpoint=CheckpointConfig(tmp_path, every_seconds=None, every_steps=1))
    run = _run([first, second], spec)
    outcome = _ok(run)

    assert run.phases == [S, R, C, R, C, RS, S, R, C, R, F, FD]
    assert first.calls == ["start", "pause 1", "snapshot 1", "exact_step",
                           "save ckpt-000000000001-000", "resume 1", "pause 2", "close"]
    assert second.calls == ["start", "pause 1", "snapshot 1", "exact_step",
                            "save ckpt-000000000003-001", "resume 1", "stop None",
                            "save ckpt-000000000003-001", "close"]
    assert first.made_with is not None and first.made_with[1:] == ("phases-g0", None)
    assert second.made_with is not None
    roles, job, restore = second.made_with
    assert job == "phases-g1" and roles["trainer"] == first.roles["trainer"]
    shard = str(tmp_path / "ckpt-000000000001-000" / "shard-0.safetensors")
    assert restore == {"files": [{"path": shard, "start": 0, "stop": N_PARAMS}], "step": 1,
                       "samples": 10, "ledger": {"paused_at": 1}, "rng": {"0": "rng-1"}}
    [failure] = outcome.log.failures
    assert (failure["role"], failure["worker"], failure["action"], failure["generation"]) == \
        ("trainer-0", "tcp://10.0.0.9:4000", "restart", 0)
    assert failure["reason"] == ("the sync group needs every rank: a new generation restarts "
                                 "from the last checkpoint")
    assert outcome.log.generations == 2 and run.controller.state.generation == 1
    assert outcome.stopped_by == "epochs=1" and [r["step"] for r in outcome.log.records] == [3]
    kinds = run.kinds
    assert kinds.index("failure") < kinds.index("generation") < kinds.index("record")
    assert run.published[kinds.index("generation")]["generation"] == 1


def test_a_failure_beyond_max_failures_raises_the_typed_error(tmp_path: Path) -> None:
    def lost(n: int) -> Failure:
        return Failure("ps", 0, f"tcp://10.0.0.{n}:4000", "removed from the scheduler")

    config = CheckpointConfig(tmp_path, every_seconds=None, every_steps=1)
    _earlier_checkpoint(config, step=1)  # the first loss restarts from it
    first = ElasticFakeEngine(faults=[Fault(lost(1))])
    second = ElasticFakeEngine(faults=[Fault(lost(2))])
    spec = _spec(strategy="async-ps", failure=FailureConfig(max_failures=1), checkpoint=config)
    run = _run([first, second], spec, resume=True, roles={"ps": 1, "trainer": 1})

    error = run.error
    assert isinstance(error, ParameterServerLost)
    assert (error.role, error.worker) == ("ps-0", "tcp://10.0.0.2:4000")
    assert "failure 2 is more than max_failures=1" in str(error)
    assert run.phases == [S, R, RS, S, R, E]
    log = run.controller.log
    assert [(f["action"], f["generation"]) for f in log.failures] == [("restart", 0), ("raise", 1)]
    assert log.generations == 2
    assert first.calls == ["start", "close"] and second.calls == ["start", "close"]
    assert second.made_with is not None and second.made_with[1] == "phases-g1"
    assert run.kinds.count("failure") == 2 and run.published[-1]["kind"] == "end"


def test_a_lost_rank_with_max_failures_zero_raises_at_once() -> None:
    lost = Failure("trainer", 1, "tcp://10.0.0.3:4000", "removed from the scheduler")
    engine = FakeEngine([(0.0, Progress(step=1))], faults=[Fault(lost)])
    run = _run([engine], _spec(failure=FailureConfig(max_failures=0)))

    error = run.error
    assert isinstance(error, WorkerLost) and not isinstance(error, ParameterServerLost)
    assert (error.role, error.worker) == ("trainer-1", "tcp://10.0.0.3:4000")
    assert "failure 1 is more than max_failures=0" in str(error)
    assert run.phases == [S, R, E]
    assert engine.calls == ["start", "close"]  # an error closes the engine, it never stops it
    [failure] = run.controller.log.failures
    assert failure["action"] == "raise"


def test_a_lost_sync_rank_before_any_checkpoint_restarts_from_the_start() -> None:
    lost = Failure("trainer", 0, "tcp://10.0.0.4:4000", "raised")
    first = FakeEngine([(0.0, Progress(step=3))], faults=[Fault(lost)])
    second = FakeEngine([(0.0, Progress(step=5)), (0.05, Epochs(completed=2))], ends_at=0.1)
    outcome = _ok(run := _run([first, second], _spec(epochs=2)))

    assert run.phases == [S, R, RS, S, R, F, FD]
    assert second.made_with is not None and second.made_with[2] is None  # the initial state
    [failure] = outcome.log.failures
    assert failure["action"] == "restart"
    assert "no checkpoint was written yet" in failure["reason"]
    assert outcome.log.generations == 2 and outcome.stopped_by == "epochs=2"


def test_a_lost_scorer_is_replaced_and_a_lost_async_trainer_retired() -> None:
    scorer = Failure("scorer", 0, "tcp://10.0.0.5:4000", "raised")
    trainer = Failure("trainer", 1, "tcp://10.0.0.6:4000", "removed from the scheduler")
    engine = ElasticFakeEngine([(0.0, Progress(step=4)), (0.05, Epochs(completed=1))],
                               ends_at=0.1, faults=[Fault(scorer), Fault(trainer)])
    run = _run([engine], _spec(strategy="async-ps"), roles={"ps": 1, "trainer": 2, "scorer": 1})
    outcome = _ok(run)

    assert run.phases == [S, R, F, FD]
    assert engine.calls == ["start", "replace scorer on 1 worker(s)", "retire 1", "stop None",
                            "close"]
    assert [(f["role"], f["action"]) for f in outcome.log.failures] == \
        [("scorer-0", "replace"), ("trainer-1", "continue")]
    assert outcome.log.generations == 1 and outcome.stopped_by == "epochs=1"


# -- errors in the other phases --------------------------------------------------------------------
def test_an_engine_that_cannot_start_errors_from_starting() -> None:
    engine = FakeEngine(start_error=TrainingTimeout("ps-0 did not start within timeout=5 s"))
    run = _run([engine], _spec())

    assert isinstance(run.error, TrainingTimeout)
    assert run.phases == [S, E]
    assert engine.calls == ["start", "close"]
    assert run.published[-1]["error"] == "TrainingTimeout: ps-0 did not start within timeout=5 s"


def test_an_engine_that_fails_to_stop_errors_from_finishing(tmp_path: Path) -> None:
    engine = FakeEngine([(0.0, Progress(step=2)), (0.02, Epochs(completed=1))], ends_at=0.05,
                        stop_error=TrainingTimeout("the final score did not arrive"))
    spec = _spec(checkpoint=CheckpointConfig(tmp_path, every_seconds=None))
    run = _run([engine], spec)

    assert isinstance(run.error, TrainingTimeout)
    assert run.phases == [S, R, F, E]
    assert engine.calls == ["start", "stop None", "close"]
    assert CheckpointStore(spec.checkpoint).complete() == []


def test_a_restart_that_cannot_place_its_roles_errors_from_restarting(tmp_path: Path) -> None:
    # resume=True continues the earlier fit's history and restarts from its checkpoint.
    config = CheckpointConfig(tmp_path, every_seconds=None)
    earlier = _earlier_checkpoint(config, step=4)

    def no_room(alive: Mapping[str, int]) -> Roles:
        raise InvalidInput([f"{len(alive)} worker(s) cannot hold the roles"])

    lost = Failure("trainer", 0, "tcp://10.0.0.7:4000", "removed from the scheduler")
    engine = FakeEngine(faults=[Fault(lost)])
    run = _run([engine], _spec(checkpoint=config), resume=True, plan=no_room)

    assert isinstance(run.error, InvalidInput)
    assert run.phases == [S, R, RS, E]
    assert engine.made_with is not None and engine.made_with[2] is not None
    assert engine.made_with[2]["step"] == 4 and engine.made_with[2]["samples"] == 40
    log = run.controller.log
    assert log.records == [earlier] and log.elapsed_before == 2.0
    assert [f["action"] for f in log.failures] == ["restart"]  # the resumed checkpoint counts
    # Closed by the restart, and once more on the way out (close never raises).
    assert engine.calls[0] == "start" and set(engine.calls[1:]) == {"close"}


def test_the_job_state_refuses_a_move_the_machine_does_not_allow() -> None:
    state = JobState()
    for wrong, right in [(F, R), (S, F), (R, FD), (E, None)]:
        before = state.phase
        with pytest.raises(RuntimeError) as info:
            state.enter(wrong)
        assert str(info.value) == f"job state: {before.value} -> {wrong.value} is not a transition"
        assert state.phase is before
        if right is not None:
            state.enter(right)
    assert state.history == [S, R, F] and state.phase is FD



def test_a_loss_seen_with_the_stopping_score_keeps_what_the_stop_claims(tmp_path: Path) -> None:
    config = CheckpointConfig(tmp_path, every_seconds=None)
    _earlier_checkpoint(config, step=4)
    lost = Failure("ps", 0, "tcp://10.0.0.8:4000", "removed from the scheduler")
    # The score is read in the same controller iteration as the first look at the roles.
    first = ElasticFakeEngine([(0.0, _score(7, accuracy=0.95)), (0.0, Progress(step=9))],
                              faults=[Fault(lost)])
    second = ElasticFakeEngine([(0.0, Progress(step=8)), (0.05, _score(8, accuracy=0.96))])
    spec = _spec(strategy="async-ps", stop=[StopAtScore("accuracy", 0.9)], checkpoint=config)
    outcome = _ok(_run([first, second], spec, resume=True, roles={"ps": 1, "trainer": 1}))

    assert outcome.stopped_by == "StopAtScore(accuracy>=0.9)"
    # The stop decided in the pass that found the loss is withdrawn: the next generation trains
    # on from the checkpoint until its own score stops it (step 8), never the checkpoint's
    # step 4 under the stop's reason from a generation stopped before it trained.
    assert outcome.model_step == 8
    np.testing.assert_array_equal(outcome.ending.params, np.full(N_PARAMS, outcome.model_step))


def test_scores_queued_behind_the_stopping_score_stay_out_of_the_history() -> None:
    # On a loaded machine the scorer runs ahead of the controller: scores of later steps are
    # already queued when a score stops the job. The result holds the parameters scored at the
    # stopping step, so the history ends with that score (a later, lower one after it once
    # made the history's last row contradict `stopped_by`).
    engine = FakeEngine([(0.0, Started(trainer=-1)), (0.0, Progress(step=9)),
                         (0.02, _score(4, accuracy=0.5, loss=1.2)),
                         (0.04, _score(7, accuracy=0.95, loss=0.3)),
                         (0.04, _score(8, accuracy=0.85, loss=0.6)),
                         (0.04, _score(9, accuracy=0.97, loss=0.2))])
    run = _run([engine], _spec(stop=[StopAtScore("accuracy", 0.9)]))
    outcome = _ok(run)

    assert outcome.stopped_by == "StopAtScore(accuracy>=0.9)" and outcome.model_step == 7
    np.testing.assert_array_equal(outcome.ending.params, np.full(N_PARAMS, 7.0))
    assert [r["step"] for r in outcome.log.records] == [4, 7]
    assert outcome.log.records[-1]["accuracy"] == 0.95


class _Forgetful(FakeEngine):
    """An engine whose scorer no longer holds the stopping score's snapshot at the stop."""

    async def stop(self, *, keep_step: int | None) -> Any:
        self.scored.clear()
        return await super().stop(keep_step=keep_step)


def test_a_stopping_snapshot_no_longer_kept_is_closed_by_the_final_parameters_score() -> None:
    engine = _Forgetful([(0.0, Started(trainer=-1)), (0.0, Progress(step=9)),
                         (0.02, _score(4, accuracy=0.5, loss=1.2)),
                         (0.04, _score(7, accuracy=0.95, loss=0.3)),
                         (0.04, _score(8, accuracy=0.85, loss=0.6))],
                        final_score={"accuracy": 0.8, "loss": 0.7})
    run = _run([engine], _spec(stop=[StopAtScore("accuracy", 0.9)]))
    outcome = _ok(run)

    assert outcome.stopped_by == "StopAtScore(accuracy>=0.9)"
    # The result holds the final parameters, and the history ends with their score.
    assert outcome.model_step == 9
    assert [(r["step"], r["accuracy"]) for r in outcome.log.records] == \
        [(4, 0.5), (7, 0.95), (9, 0.8)]
