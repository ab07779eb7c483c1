"""The Trainer with the models, losses and inputs PyTorch users bring (beyond the demo's MLP)."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt


@pytest.fixture(scope="module")
def digits() -> tuple:
    X, y = dt.datasets.digits(20_000, seed=0, chunks=5_000)
    return X, y, dt.datasets.digits_test()


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _trainer(client: Client, module: torch.nn.Module, **kw) -> dt.Trainer:
    options = dict(lr=3e-3, ps=1, workers=2, batch_size=64, epochs=1, score_every=0.2,
                   progress=False, client=client)
    options.update(kw)
    return dt.Trainer(module, **options)


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_a_loss_module_with_options_trains_and_scores(client: Client, digits: tuple,
                                                      strategy: str) -> None:
    X, y, validation = digits
    loss = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    result = _trainer(client, _mlp(), loss=loss, strategy=strategy, epochs=3).fit(
        X, y, validation=validation)
    # Two asynchronous trainers end at 0.89-0.95 from run to run (staleness); chance is 0.1.
    assert result.history["accuracy"].iloc[-1] > 0.85
    # The scores' loss is the smoothed loss of the returned model (not plain cross-entropy).
    net = result.model.eval()
    with torch.no_grad():
        out = net(torch.from_numpy(validation[0]))
        smoothed = float(loss(out, torch.from_numpy(validation[1])))
        plain = float(torch.nn.functional.cross_entropy(out, torch.from_numpy(validation[1])))
    assert result.history["loss"].iloc[-1] == pytest.approx(smoothed, rel=1e-4)
    assert abs(smoothed - plain) > 1e-3


def test_a_loss_function_trains_a_regression(client: Client) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8_000, 4)).astype(np.float32)
    y = (x @ np.array([[1.0, -1.0], [0.5, 0.0], [0.0, 2.0], [1.0, 1.0]], dtype=np.float32))

    def huber(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.huber_loss(out, target)

    X, Y = da.from_array(x, chunks=(2_000, 4)), da.from_array(y, chunks=(2_000, 2))
    # One trainer, no push in flight: two async trainers' staleness made the last score vary
    # 0.002-0.017 from run to run at this rate.
    result = _trainer(client, torch.nn.Linear(4, 2), loss=huber, lr=0.05, epochs=3, workers=1,
                      prefetch=False).fit(
        X, Y, validation=(x[:1000], y[:1000]))
    assert "accuracy" not in result.history or result.history["accuracy"].isna().all()
    assert result.history["loss"].iloc[-1] < 0.01


def test_int64_token_ids_reach_an_embedding(client: Client) -> None:
    # The class is the token at position 0; an Embedding model must see the ids unconverted.
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 20, size=(6_000, 3)).astype(np.int64)
    labels = (ids[:, 0] % 4).astype(np.int64)
    net = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Flatten(), torch.nn.Linear(24, 4))
    X, Y = da.from_array(ids, chunks=(1_500, 3)), da.from_array(labels, chunks=1_500)
    result = _trainer(client, net, lr=0.02, epochs=3).fit(X, Y, validation=(ids[:1000], labels[:1000]))
    assert result.history["accuracy"].iloc[-1] > 0.95


def test_a_metric_typo_is_refused_before_any_work(client: Client, digits: tuple) -> None:
    X, y, validation = digits
    before = set(client.futures)
    with pytest.raises(dt.InvalidInput) as info:
        _trainer(client, _mlp(), stop=[dt.StopAtScore("acc", 0.5), dt.EarlyStopping("los")]).fit(
            X, y, validation=validation)
    text = str(info.value)
    assert "StopAtScore(acc>=0.5) watches 'acc'" in text and "'los'" in text
    assert "['loss', 'accuracy']" in text
    assert not set(client.futures) - before
    regression = _trainer(client, torch.nn.Linear(64, 1), loss="mse",
                          stop=[dt.StopAtScore("accuracy", 0.5)])
    with pytest.raises(dt.InvalidInput, match=r"hold \['loss'\]"):
        regression.fit(X, y.astype(np.float32)[:, None], validation=(validation[0],
                       validation[1].astype(np.float32)[:, None]))


def test_stop_conditions_start_fresh_at_each_fit(client: Client, digits: tuple) -> None:
    X, y, validation = digits
    stop = dt.EarlyStopping("accuracy", patience=3)
    # Epochs enough for several scores: one epoch took 0.08 s in a fresh-clone run, one score.
    trainer = _trainer(client, _mlp(), stop=[stop], score_every=0.05, epochs=20)
    first = trainer.fit(X, y, validation=validation)
    stop.wait = 3  # as a stopped condition would leave it
    second = trainer.fit(X, y, validation=validation)
    # A condition that kept its state would fire at the second fit's first score.
    assert len(second.history) > 1 or second.stopped_by != first.stopped_by


def test_fit_does_not_change_the_client_parameter(client: Client, digits: tuple) -> None:
    X, y, validation = digits
    trainer = dt.Trainer(_mlp(), ps=1, workers=2, progress=False)  # no client= given
    trainer.fit(X[:5_000], y[:5_000], validation=validation)  # the session's default client
    assert trainer.client is None and trainer.get_params()["client"] is None


def test_metrics_functions_objects_and_aliases_are_scored_and_watched(client: Client,
                                                                      digits: tuple) -> None:
    X, y, validation = digits

    def top3(out: torch.Tensor, target: torch.Tensor) -> float:
        return float((out.topk(3, dim=1).indices == target[:, None]).any(dim=1).float().mean())

    class Errors:  # the torchmetrics protocol: reset, update per batch, compute
        def reset(self) -> None:
            self.wrong = self.n = 0

        def update(self, out: torch.Tensor, target: torch.Tensor) -> None:
            self.wrong += int((out.argmax(dim=1) != target).sum())
            self.n += len(target)

        def compute(self) -> float:
            return self.wrong / self.n

    result = _trainer(client, _mlp(), metrics={"top3": top3, "errors": Errors(), "acc": "accuracy"},
                      # Epochs enough for a score before they end (3 took 0.36 s here, less
                      # than two scores' time): the stop, not the epochs, ends the fit.
                      stop=[dt.StopAtScore("top3", 0.95)], epochs=30).fit(X, y, validation=validation)
    last = result.history.iloc[-1]
    assert last["top3"] >= last["acc"] == last["accuracy"]
    assert last["errors"] == pytest.approx(1 - last["accuracy"])
    assert result.stopped_by == "StopAtScore(top3>=0.95)"
    with pytest.raises(dt.InvalidInput, match="metrics\\['x'\\]='f1' is not a metric"):
        _trainer(client, _mlp(), metrics={"x": "f1"}).fit(X, y, validation=validation)


def test_an_optimizer_class_with_options(client: Client, digits: tuple) -> None:
    X, y, validation = digits
    # One trainer, no push in flight: the servers apply the class's steps in a fixed order, so
    # the score does not hang on how stale two trainers' pushes happened to be (momentum SGD is
    # the optimizer staleness hurts most).
    result = _trainer(client, _mlp(), optimizer=torch.optim.SGD, lr=0.02,
                      optimizer_options={"momentum": 0.9, "nesterov": True}, epochs=3,
                      workers=1, prefetch=False).fit(X, y, validation=validation)
    assert result.history["accuracy"].iloc[-1] > 0.85  # chance is 0.1; the MLP tops out near 0.95
    with pytest.raises(dt.InvalidInput, match="optimizer=LBFGS is invalid"):
        _trainer(client, _mlp(), optimizer=torch.optim.LBFGS).fit(X, y, validation=validation)


def test_warm_start_continues_from_the_last_fit_and_predict_is_local(client: Client,
                                                                     digits: tuple) -> None:
    X, y, validation = digits
    trainer = _trainer(client, _mlp(), epochs=1, lr=1e-3)
    first = trainer.fit(X, y, validation=validation)
    cold = trainer.fit(X, y, validation=validation)
    warm = trainer.fit(X, y, validation=validation, warm_start=True)
    assert warm.history["loss"].iloc[0] < cold.history["loss"].iloc[0]
    assert warm.history["accuracy"].iloc[-1] >= first.history["accuracy"].iloc[-1] - 0.01
    labels = warm.predict(validation[0]).argmax(axis=1)
    assert np.mean(labels == validation[1]) == pytest.approx(warm.history["accuracy"].iloc[-1])
