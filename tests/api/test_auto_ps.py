"""``ps="auto"``: the cost model's probe on a real cluster, and the Trainer's choice from it."""

from __future__ import annotations

import logging
import os

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt
from dask_train.api._auto_ps import probe_arguments
from dask_train.api._plan import FitPlan
from dask_train.engines.measure.ps_costs import probe_costs
from dask_train.policy._settings import OptimizerSettings


def _data(n: int = 8000):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 3))).argmax(axis=1)
    return da.from_array(x, chunks=(1000, 8)), da.from_array(y, chunks=1000), (x[:1000], y[:1000])


def _plan(trainer: dt.Trainer) -> FitPlan:
    return FitPlan.of(trainer.get_params(), model=trainer.module)


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def test_probe_measures_the_jobs_costs_on_the_cluster(client: Client) -> None:
    _, _, (x, y) = _data()
    model = probe_costs(client, _net(), x[:64], y[:64], loss="cross_entropy",
                        optim=OptimizerSettings("adam", 1e-3), prefetch=1, grad_accumulation=2)
    assert model.n_params == 8 * 32 + 32 + 32 * 3 + 3
    assert model.batch_size == 128  # two batches of 64 a push
    assert 0 < model.compute_s < 1 and 0 < model.update_s_per_param < 1e-3
    assert model.link_bytes_per_s > 1e6  # loopback: far above any real link's rate
    assert 0 < model.message_s < 1
    # Two workers of one machine: two places for roles sharing its cores.
    assert model.hosts == 2 and model.shared_cores == float(os.cpu_count() or 1)
    assert model.predict(workers=2, ps=1).steps_per_s > 0


def test_auto_chooses_a_count_logs_it_and_trains(client: Client, caplog: pytest.LogCaptureFixture
                                                 ) -> None:
    X, Y, validation = _data()
    trainer = dt.Trainer(_net(), ps="auto", workers=2, lr=1e-2, batch_size=32, epochs=2,
                         progress=False, timeout=60, client=client)
    with caplog.at_level(logging.INFO, logger="dask_train"):
        result = trainer.fit(X, Y, validation=validation)
    lines = [r.getMessage() for r in caplog.records if "ps='auto'" in r.getMessage()]
    assert len(lines) == 1, lines
    chosen = len(result.roles["ps"])
    assert f"ps={chosen} for 2 trainers: predicted" in lines[0]
    assert "samples/s, limited by" in lines[0]
    assert chosen in (1, 2)
    assert trainer.get_params()["ps"] == "auto"  # the hyper-parameter is kept as given
    assert result.samples == 2 * 8000 and result.history["accuracy"].iloc[-1] > 0.8


def test_auto_is_free_for_sync_and_bad_ps_values_are_refused(client: Client,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    X, Y, validation = _data(4000)
    with caplog.at_level(logging.INFO, logger="dask_train"):
        result = dt.Trainer(_net(), strategy="sync", ps="auto", workers=2, batch_size=64,
                            epochs=1, progress=False, client=client).fit(X, Y, validation=validation)
    assert result.samples == 4000
    assert not [r for r in caplog.records if "ps='auto'" in r.getMessage()]
    for bad in ("many", 0, 1.5):
        with pytest.raises(dt.InvalidInput) as info:
            dt.Trainer(_net(), ps=bad, progress=False, client=client).fit(X, Y)
        assert f"ps={bad!r} is invalid: use 'auto' or an integer >= 1" in str(info.value)


def test_the_probe_measures_one_trainers_batch_of_a_global_batch() -> None:
    # global_batch_size=64 over 2 trainers: each runs batches of 32 rows, which the probe must
    # measure, not batch_size (128 by default, unused when a global batch is given).
    trainer = dt.Trainer(_net(), ps="auto", workers=2, global_batch_size=64, grad_accumulation=2,
                         progress=False)
    rows, settings = probe_arguments(_plan(trainer), n_rows=8000)
    per_trainer = dt.Trainer(_net(), ps="auto", workers=2, batch_size=32, progress=False)
    assert rows == 32 == trainer.per_trainer_batch()
    assert probe_arguments(_plan(per_trainer), n_rows=8000)[0] == 32  # batch_size as given
    assert probe_arguments(_plan(trainer), n_rows=20)[0] == 20  # never more rows than the data has
    assert settings["grad_accumulation"] == 2 and settings["prefetch"] == 1
