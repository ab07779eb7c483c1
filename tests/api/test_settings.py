"""The typed settings: a Trainer's parameters, the frozen job spec and the roles' configuration."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import dask_train as dt
from dask_train.api._build import job_spec
from dask_train.api._settings import Settings
from dask_train.api._validate import check_settings
from dask_train.engines._spec import JobSpec, WorkerConfig


def test_settings_hold_every_trainer_parameter_by_name() -> None:
    params = list(inspect.signature(dt.Trainer.__init__).parameters)[1:]
    assert Settings.names() == params  # a parameter added to the Trainer must be validated too
    trainer = dt.Trainer(torch.nn.Linear(4, 2), lr=0.5, workers=3, stop=dt.StopAfter(1.0))
    settings = Settings.of(trainer)
    assert settings.lr == 0.5 and settings.workers == 3
    assert settings.stop == trainer.stop and isinstance(settings.stop, list)
    with pytest.raises(AttributeError):
        settings.learning_rate  # noqa: B018  (a misspelt name fails, never a silent default)


def test_validation_reads_the_typed_settings() -> None:
    trainer = dt.Trainer(torch.nn.Linear(4, 2), lr=-1.0, on_nan="ignore", batch_size=0)
    problems = check_settings(Settings.of(trainer))
    assert any(p.startswith("lr=-1.0") for p in problems), problems
    assert any(p.startswith("on_nan='ignore'") for p in problems), problems
    assert any(p.startswith("batch_size=0") for p in problems), problems


def test_the_job_spec_is_frozen_and_the_worker_config_typed() -> None:
    trainer = dt.Trainer(torch.nn.Linear(4, 2), global_batch_size=64, workers=2,
                         stop=[dt.StopAtStep(10)])
    spec = job_spec(trainer)
    assert isinstance(spec, JobSpec) and spec.batch_size == 32  # the per-trainer batch
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.lr = 1.0  # type: ignore[misc]
    config = WorkerConfig.from_spec(spec, topic="t", restore={"rng": {"0": "abc"}})
    assert config.batch_size == 32 and config.max_step == 10 and config.rng == {"0": "abc"}
    assert config.device_for("tcp://w:1") is None
    gpu = dataclasses.replace(config, device_kind="cuda", devices={"tcp://w:1": "cuda:1"})
    assert gpu.device_for("tcp://w:1") == "cuda:1" and gpu.device_for("tcp://new:2") == "cuda"
