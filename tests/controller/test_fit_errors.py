"""Bad input is reported before any training starts, every problem at once, each with its fix."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt


def _net(n_in: int = 4, n_out: int = 3) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(n_in, 8), torch.nn.ReLU(), torch.nn.Linear(8, n_out))


def _xy(n: int = 100, n_in: int = 4, n_classes: int = 3):
    rng = np.random.default_rng(0)
    X = da.from_array(rng.normal(size=(n, n_in)).astype(np.float32), chunks=(25, n_in))
    y = da.from_array(rng.integers(0, n_classes, size=n), chunks=25)
    return X, y


def _fit_error(client: Client, trainer_kwargs: dict, X, y, validation=None) -> dt.InvalidInput:
    trainer = dt.Trainer(**{"progress": False, "client": client, **trainer_kwargs})
    before = set(client.futures)
    with pytest.raises(dt.InvalidInput) as info:
        trainer.fit(X, y, validation=validation)
    # Nothing new is left on the cluster (an earlier test's futures may still be releasing).
    assert not set(client.futures) - before
    return info.value


def test_all_setting_problems_at_once(client: Client) -> None:
    X, y = _xy()
    err = _fit_error(
        client,
        dict(module=_net(), ps=0, workers=0, batch_size=0, optimizer="adamx", loss="hinge", lr=-1.0),
        X,
        y,
    )
    text = str(err)
    assert len(err.problems) == 6
    assert "ps=0 is invalid: use 'auto' or an integer >= 1." in text
    assert "workers=0 is invalid: pass a number of ranks >= 1, (least, most)" in text
    assert "batch_size=0 is invalid: use an integer >= 1." in text
    assert "optimizer='adamx' is unknown: use one of" in text and "'adam'" in text
    assert "loss='hinge' is unknown: use one of" in text and "'cross_entropy'" in text
    assert "lr=-1.0 is invalid" in text


def test_length_mismatch(client: Client) -> None:
    X, _ = _xy(100)
    _, y = _xy(75)
    err = _fit_error(client, dict(module=_net()), X, y)
    assert "X has 100 rows but y has 75: pass one label per row of X." in str(err)


def test_unknown_chunk_sizes(client: Client) -> None:
    X, y = _xy()
    X_unknown = X[X[:, 0] > -100]  # boolean indexing leaves the row counts unknown
    err = _fit_error(client, dict(module=_net()), X_unknown, y)
    assert "X has unknown chunk sizes: call X.compute_chunk_sizes() first" in str(err)


def test_non_numeric_dtype(client: Client) -> None:
    _, y = _xy()
    X = da.from_array(np.full((100, 4), "a", dtype=object), chunks=(25, 4))
    err = _fit_error(client, dict(module=_net()), X, y)
    assert "X has dtype object, which is not numeric" in str(err)


def test_labels_outside_the_module_output(client: Client) -> None:
    X, y = _xy(n_classes=5)  # labels 0..4, a module with 3 outputs
    trainer = dt.Trainer(_net(n_out=3), progress=False, client=client)
    with pytest.raises(dt.InvalidInput) as info:
        trainer.fit(X, y)
    assert "y has labels from 0 to 4 but the module outputs 3 classes" in str(info.value)
    assert "enlarge the output layer or re-encode y" in str(info.value)


def test_module_output_does_not_fit_the_loss(client: Client) -> None:
    X, y = _xy()
    err = _fit_error(client, dict(module=_net(n_out=1)), X, y)
    assert "module output shape (2, 1) does not fit loss='cross_entropy'" in str(err)
    err = _fit_error(client, dict(module=_net(n_in=7)), X, y)
    assert "module failed on a batch shaped like X (2, 4)" in str(err)
    y_float = y.astype(np.float32)
    err = _fit_error(client, dict(module=_net(n_out=1), loss="mse"), X, y_float)
    assert "module output shape (2, 1) does not fit loss='mse' with y of shape (n, )" in str(err)


def test_score_based_stop_needs_validation(client: Client) -> None:
    X, y = _xy()
    err = _fit_error(client, dict(module=_net(), stop=[dt.StopAtScore("accuracy", 0.9)]), X, y)
    assert "needs scores: pass validation=(X_val, y_val) to fit." in str(err)


def test_score_based_stop_needs_a_scorer(client: Client) -> None:
    X, y = _xy()
    xv, yv = np.zeros((10, 4), dtype=np.float32), np.zeros(10, dtype=np.int64)
    err = _fit_error(
        client, dict(module=_net(), scorer=0, stop=[dt.EarlyStopping("loss")]), X, y, (xv, yv)
    )
    assert "needs scores but scorer=0: use scorer=1." in str(err)


def test_validation_shape_mismatch(client: Client) -> None:
    X, y = _xy()
    xv = np.zeros((10, 5), dtype=np.float32)
    yv = np.zeros(9, dtype=np.int64)
    err = _fit_error(client, dict(module=_net()), X, y, validation=(xv, yv))
    assert len(err.problems) == 2
    assert "validation has 10 rows in X_val but 9 in y_val" in str(err)
    assert "validation X_val has sample shape (5,) but X has (4,)" in str(err)


def test_bad_optimizer_options_and_stop_entries(client: Client) -> None:
    X, y = _xy()
    err = _fit_error(
        client,
        dict(module=_net(), optimizer="sgd", optimizer_options={"momentum": -1}, stop=["soon"]),
        X,
        y,
    )
    assert "optimizer_options={'momentum': -1} are invalid for 'sgd'" in str(err)
    assert "stop[0]='soon' is invalid: use dt.StopAtScore" in str(err)


def test_set_params_rejects_unknown_names() -> None:
    trainer = dt.Trainer(_net())
    with pytest.raises(dt.InvalidInput, match="lrate= is not a Trainer parameter"):
        trainer.set_params(lrate=0.1)
    assert trainer.set_params(lr=0.5).lr == 0.5
    assert trainer.get_params()["lr"] == 0.5


def test_recovery_settings_are_checked_with_the_rest(client: Client) -> None:
    X, y = _xy()
    err = _fit_error(
        client, dict(module=_net(), on_nan="ignore", checkpoint=3, failure=3), X, y
    )
    text = str(err)
    assert "on_nan='ignore'" in text and "'stop'" in text and "'skip'" in text
    # A path is a checkpoint config's shortcut (checkpoint="ckpt/"); a number is neither.
    assert "checkpoint=3" in text and "dt.CheckpointConfig" in text and "directory" in text
    assert "failure=3" in text and "dt.FailureConfig" in text
    with pytest.raises(dt.InvalidInput, match="keep=0"):
        dt.CheckpointConfig("ckpt/", keep=0)
    with pytest.raises(dt.InvalidInput, match="max_failures=-1"):
        dt.FailureConfig(max_failures=-1)
