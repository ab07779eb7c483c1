"""The typed settings: a Trainer's parameters by concern, the frozen job spec and the roles'
configuration, and the one validation path the Trainer, dt.run and the CLI share."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import dask_train as dt
from dask_train.api._build import job_spec
from dask_train.api._plan import FitPlan
from dask_train.api._run import check_run
from dask_train.api._settings import Settings
from dask_train.engines._registry import ENGINES, engine_entry
from dask_train.engines._spec import JobSpec, RoleConfig, TrainSettings
from dask_train.policy._settings import DataSettings, OptimizerSettings, per_trainer_batch


def _plan(trainer: dt.Trainer) -> FitPlan:
    return FitPlan.of(trainer.get_params(), model=trainer.module)


def _run_args(**changes: object) -> dict[str, object]:
    """dt.run's keyword arguments, its defaults with ``changes``."""
    defaults = {k: p.default for k, p in inspect.signature(dt.run).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {**defaults, "fn": lambda ctx: None, **changes}


def test_settings_hold_every_trainer_parameter_by_name() -> None:
    params = list(inspect.signature(dt.Trainer.__init__).parameters)[1:]
    assert Settings.names() == params  # a parameter added to the Trainer must be placed too
    trainer = dt.Trainer(torch.nn.Linear(4, 2), lr=0.5, workers=3, stop=dt.StopAfter(1.0),
                         batch_size=64, checkpoint="runs/x")
    settings = Settings.of(trainer.get_params())
    assert settings.model.lr == 0.5 and settings.cluster.workers == 3
    assert settings.data.batch_size == 64 and settings.recovery.checkpoint == "runs/x"
    assert settings.stop == trainer.stop and isinstance(settings.stop, list)
    with pytest.raises(AttributeError):
        settings.model.learning_rate  # noqa: B018  (a misspelt name fails, never a silent default)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.data.batch_size = 1  # type: ignore[misc]


def test_validation_reads_each_record() -> None:
    trainer = dt.Trainer(torch.nn.Linear(4, 2), lr=-1.0, on_nan="ignore", batch_size=0,
                         device="tpu", score_every=0, checkpoint=3)
    problems = Settings.of(trainer.get_params()).problems()
    for start in ("lr=-1.0", "on_nan='ignore'", "batch_size=0", "device='tpu'", "score_every=0",
                  "checkpoint=3"):
        assert any(p.startswith(start) for p in problems), (start, problems)


def test_the_trainer_and_dt_run_say_the_same_of_the_same_value() -> None:
    trainer = dt.Trainer(torch.nn.Linear(4, 2), batch_size=0, seed=-1, timeout=0,
                         device="tpu", blocks_ahead=0, stop=["soon"], checkpoint=3)
    from_trainer = set(Settings.of(trainer.get_params()).problems())
    from_run = set(check_run(_run_args(batch_size=0, seed=-1, timeout=0, device="tpu",
                                       blocks_ahead=0, stop=["soon"], checkpoint=3)))
    shared = [p for p in from_trainer if p.split("=")[0] in
              ("batch_size", "seed", "timeout", "device", "blocks_ahead", "stop[0]",
               "checkpoint")]
    assert len(shared) == 7, from_trainer
    assert set(shared) <= from_run, sorted(set(shared) - from_run)


def test_a_path_is_a_checkpoint_config_and_a_file_is_refused_before_work(
        tmp_path: Path) -> None:
    assert dt.CheckpointConfig.of(str(tmp_path / "x")) == dt.CheckpointConfig(str(tmp_path / "x"))
    assert dt.CheckpointConfig.of(None) is None
    plan = _plan(dt.Trainer(torch.nn.Linear(4, 2), checkpoint=tmp_path / "ckpt"))
    spec = job_spec(plan, start=plan.model)
    assert spec.checkpoint == dt.CheckpointConfig(tmp_path / "ckpt")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    for path in (a_file, a_file / "below"):
        with pytest.raises(dt.InvalidInput, match="checkpoints are directories"):
            dt.CheckpointConfig(path)
        problems = Settings.of(dt.Trainer(torch.nn.Linear(4, 2), checkpoint=str(path))
                               .get_params()).problems()
        assert any("checkpoints are directories" in p for p in problems), problems
        assert any("checkpoints are directories" in p for p in check_run(
            _run_args(checkpoint=str(path))))
    assert dt.CheckpointConfig("memory://x").path == "memory://x"  # checked at its first write


def test_the_per_trainer_batch_rule_is_one() -> None:
    assert per_trainer_batch(128, None, 4) == 128 and per_trainer_batch(128, 512, 4) == 128
    assert per_trainer_batch(128, 3, 4) == 1  # at least one row
    data = DataSettings(global_batch_size=64)
    assert data.per_trainer_batch(2) == 32
    assert any("does not split evenly" in p for p in data.problems(trainers=3))
    trainer = dt.Trainer(torch.nn.Linear(4, 2), global_batch_size=64, workers=2)
    assert trainer.per_trainer_batch() == _plan(trainer).per_trainer_batch() == 32


def test_the_job_spec_is_frozen_and_the_worker_config_typed() -> None:
    trainer = dt.Trainer(torch.nn.Linear(4, 2), global_batch_size=64, workers=2,
                         stop=[dt.StopAtStep(10)], optimizer=torch.optim.SGD)
    plan = _plan(trainer)
    spec = job_spec(plan, start=plan.model)
    assert isinstance(spec, JobSpec) and spec.batch_size == 32  # the per-trainer batch
    assert isinstance(spec.train, TrainSettings) and spec.n_params == 10
    # The optimizer travels as one frozen record, the Trainer's three parameters in it.
    assert spec.train.optim == OptimizerSettings(torch.optim.SGD, 1e-3, {})
    assert spec.train.optim.label == "SGD" and spec.train.manifest()["optimizer"] == "SGD"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.train.optim.lr = 1.0  # type: ignore[misc]
    config = RoleConfig.from_spec(spec, topic="t", restore={"rng": {"0": "abc"}})
    assert config.batch_size == 32 and config.max_step == 10 and config.rng == {"0": "abc"}
    assert config.trains.module is None  # the module reaches each worker once, not per role
    assert config.trains.optim.name is torch.optim.SGD and config.device_for("tcp://w:1") is None
    gpu = dataclasses.replace(config, device_kind="cuda", devices={"tcp://w:1": "cuda:1"})
    # A worker that joined after the start: its current CUDA device, its CPU where it has none
    # (a CPU worker beside the GPU ones of a job with resources=).
    assert gpu.device_for("tcp://w:1") == "cuda:1"
    assert gpu.device_for("tcp://new:2") == ("cuda" if torch.cuda.is_available() else None)
    # What a checkpoint records: the optimizer by name (a class too), the data's settings.
    assert spec.manifest_config() == {"optimizer": "SGD", "lr": 1e-3, "grad_accumulation": 1,
                                      "batch_size": 32, "seed": 0, "epochs": 1}


def test_a_job_without_a_given_model_records_no_optimizer() -> None:
    spec = JobSpec(strategy="run", workers=2, batch_size=8, epochs=3, shuffle=True, seed=1,
                   blocks_ahead=2, timeout=5.0, stop=[], callbacks=[])
    assert spec.train is None and spec.n_params == 0
    assert spec.manifest_config() == {"batch_size": 8, "seed": 1, "epochs": 3}
    assert "optimizer" not in spec.summary()
    assert RoleConfig.from_spec(spec, topic="t").train is None


def test_engines_are_found_by_strategy() -> None:
    assert set(ENGINES) == {"async-ps", "sync", "run", "array"}
    assert engine_entry("async-ps").servers and not engine_entry("sync").servers
    assert engine_entry("sync").one_rank_per_worker and engine_entry("run").one_rank_per_worker
    assert engine_entry("sync").engine_class().__name__ == "TorchSyncEngine"
    with pytest.raises(KeyError, match="no engine runs strategy='nope'"):
        engine_entry("nope")


def test_a_fit_plan_is_its_own() -> None:
    trainer = dt.Trainer(torch.nn.Linear(4, 2), workers=2)
    first, second = _plan(trainer), _plan(trainer)
    assert first is not second and first.clock is not second.clock
    chosen = first.chose(dataclasses.replace(first.choice or _choice(), workers=3))
    assert chosen.trainers == 3 and first.trainers == 2 and second.trainers == 2
    assert "callbacks" not in first.tracked_params() and first.tracked_params()["workers"] == 2


def _choice():  # noqa: ANN202
    from dask_train.api._plan import Choice

    return Choice("async-ps", 2, 1)


def test_a_range_of_workers_is_checked_as_dt_run_checks_it() -> None:
    def problems(**kw: object) -> list[str]:
        return Settings.of(dt.Trainer(torch.nn.Linear(4, 2), **kw).get_params()).problems()

    assert problems(workers=(1, 3)) == [] and problems(workers=None, strategy="sync") == []
    [bad] = problems(workers=(3, 2))
    assert bad.startswith("workers=(3, 2) is invalid") and "1 <= least <= most" in bad
    assert set(problems(workers=(3, 2))) <= set(check_run(_run_args(workers=(3, 2))))
    [auto] = problems(workers=(2, 4), strategy="auto")
    assert "with strategy='auto'" in auto and "'async-ps' or 'sync'" in auto
    [batch] = problems(workers=(2, 4), global_batch_size=128)
    assert batch.startswith("global_batch_size=128 with workers=(2, 4)") and "batch_size=" in batch


def test_a_range_starts_with_the_workers_there_are_within_it() -> None:
    from dask_train.policy._settings import ClusterSettings

    ranged = ClusterSettings((2, 4))
    assert [ranged.trainers(n) for n in (1, 2, 3, 4, 9)] == [2, 2, 3, 4, 4]
    assert ranged.most() == 4 and ClusterSettings(3).most() == 3
    every = ClusterSettings(None)
    assert [every.trainers(n) for n in (1, 5)] == [1, 5] and every.most() is None
    spec = job_spec(_plan(dt.Trainer(torch.nn.Linear(4, 2), workers=(1, 3))).chose(_choice()),
                    start=torch.nn.Linear(4, 2))
    assert spec.trainer_cap == 3  # joiners bring it up to most
