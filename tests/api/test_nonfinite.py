"""A fit that never made a finite step raises NonFiniteLoss naming the step, the trainer and the
block; one with good steps before its first non-finite loss returns the last good parameters
(issue 55). End to end on the session's 2-worker cluster, for async-ps and sync."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt
from dask_train.controller._history import no_finite_step

CHUNK = 100
N_BLOCKS = 4


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(CHUNK * N_BLOCKS, 6)).astype(np.float32)
    return X, (X[:, 0] > 0).astype(np.int64) + (X[:, 1] > 1).astype(np.int64)


def _fit(client: Client, X: np.ndarray, y: np.ndarray, strategy: str, **kw: object) -> dt.FitResult:
    trainer = dt.Trainer(_net(), loss="cross_entropy", optimizer="sgd", lr=0.05,
                         strategy=strategy, workers=2, scorer=0, batch_size=25, epochs=1, seed=3,
                         progress=False, client=client, **kw)  # type: ignore[arg-type]
    return trainer.fit(da.from_array(X, chunks=(CHUNK, -1)), da.from_array(y, chunks=CHUNK))


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_a_fit_whose_first_loss_is_nan_raises_naming_step_trainer_and_block(
        client: Client, strategy: str) -> None:
    X, y = _data()
    X[:, 2] = np.nan  # every row: no batch has a finite loss
    with pytest.raises(dt.NonFiniteLoss) as info:
        _fit(client, X, y, strategy)
    err = info.value
    text = str(err)
    assert isinstance(err, dt.DaskTrainError) and isinstance(err, ValueError)
    assert err.step == 0 and err.loss == "nan"
    assert err.trainer in ("trainer-0", "trainer-1")
    assert 0 <= err.block < N_BLOCKS and err.epoch == 0
    assert f"on {err.trainer} at step 0" in text and f"block {err.block} of X" in text
    assert "Clean the data" in text and "on_nan='skip'" in text
    assert "no trained parameters" in text


def test_a_fit_that_skips_every_batch_raises_too(client: Client) -> None:
    X, y = _data()
    X[:, 2] = np.inf
    with pytest.raises(dt.NonFiniteLoss) as info:
        _fit(client, X, y, "async-ps", on_nan="skip")
    text = str(info.value)
    assert "on_nan='skip' left each out" in text and "Clean the data" in text
    assert "pass on_nan='skip'" not in text  # it was given: the fix is the data or the model


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_a_nan_after_good_steps_keeps_the_last_good_parameters(client: Client, strategy: str) -> None:
    X, y = _data()
    X[CHUNK * N_BLOCKS - 1, 2] = np.nan  # one row of the last block
    result = _fit(client, X, y, strategy, shuffle=False)
    assert result.steps > 0, result.nonfinite
    assert result.stopped_by.startswith("non-finite loss"), result.stopped_by
    assert result.nonfinite and result.nonfinite[0]["block"] == N_BLOCKS - 1
    assert all(torch.isfinite(p).all() for p in result.model.parameters())


def test_no_finite_step_is_decided_on_the_steps_and_the_losses_only() -> None:
    nan = {"role": "trainer-1", "step": 0, "loss": "nan", "epoch": 0, "block": 2}
    score = {"role": "scorer", "step": 0, "metrics": ["loss"]}
    assert no_finite_step([nan], steps=5, on_nan="stop") is None  # good steps: today's result
    assert no_finite_step([score], steps=0, on_nan="stop") is None  # a score is not a step
    assert no_finite_step([], steps=0, on_nan="stop") is None
    err = no_finite_step([score, nan, {**nan, "role": "trainer-0", "block": 1}], steps=0,
                         on_nan="stop")
    assert err is not None and (err.trainer, err.block, err.step) == ("trainer-1", 2, 0)
    unknown = no_finite_step([{**nan, "block": -1, "epoch": -1}], steps=0, on_nan="stop")
    assert unknown is not None and "a block not known" in str(unknown)
