"""The models PyTorch users bring, trained to a held-out target in both strategies: a CNN on the
digits as 1x8x8 images, a BatchNorm MLP; sample and class weights, multi-output targets, mixed
precision and the device setting."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt


@pytest.fixture(scope="module")
def digits() -> tuple:
    X, y = dt.datasets.digits(24_000, seed=0, chunks=6_000)
    return X, y, dt.datasets.digits_test()


def cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),  # 16 x 4 x 4
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(32 * 16, 10))


def bn_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _accuracy(module: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    module.eval()
    with torch.no_grad():
        return float((module(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
@pytest.mark.parametrize("model", ["cnn", "bn_mlp"])
def test_a_cnn_and_a_batchnorm_mlp_reach_095(client: Client, digits: tuple, strategy: str,
                                             model: str) -> None:
    X, y, (xv, yv) = digits
    if model == "cnn":  # the same rows as 1x8x8 images
        X, xv = X.reshape(-1, 1, 8, 8), xv.reshape(-1, 1, 8, 8)
    net = cnn() if model == "cnn" else bn_mlp()
    # Epochs enough for the scores to catch up: the job stops at 0.95, usually within two
    # epochs; on a loaded machine the async trainers' staleness grows, and the scorer (within
    # its share of a core) scores less often than the epochs go by: six epochs ended, unscored
    # at 0.95, in a loaded fresh-clone run.
    result = dt.Trainer(net, strategy=strategy, ps=1, workers=2, lr=3e-3, batch_size=64,
                        epochs=40, score_every=0.5, progress=False, client=client,
                        stop=[dt.StopAtScore("accuracy", 0.95)]).fit(X, y, validation=(xv, yv))
    assert result.stopped_by == "StopAtScore(accuracy>=0.95)"
    # The returned model (buffers included) is the one that earned the score.
    assert _accuracy(result.model, xv, yv) >= 0.95


def test_sample_weights_choose_between_conflicting_targets(client: Client) -> None:
    # Two-output regression where half the rows say y = x @ w and the other half y = -(x @ w).
    # Weighing the second half 0 must learn w; unweighted, the halves cancel out to about 0.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8_000, 3)).astype(np.float32)
    w = np.array([[1.0, -2.0], [0.5, 1.0], [-1.0, 0.0]], dtype=np.float32)
    sign = np.where(np.arange(8_000) % 2 == 0, 1.0, -1.0).astype(np.float32)[:, None]
    y = (x @ w) * sign
    weights = (sign[:, 0] > 0).astype(np.float32)
    X, Y = da.from_array(x, chunks=(2_000, 3)), da.from_array(y, chunks=(2_000, 2))
    common = dict(loss="mse", lr=0.02, ps=1, workers=2, batch_size=64, epochs=3, scorer=0,
                  progress=False, client=client)
    torch.manual_seed(0)
    weighted = dt.Trainer(torch.nn.Linear(3, 2, bias=False), **common).fit(
        X, Y, sample_weight=da.from_array(weights, chunks=2_000))
    torch.manual_seed(0)
    plain = dt.Trainer(torch.nn.Linear(3, 2, bias=False), **common).fit(X, Y)
    np.testing.assert_allclose(weighted.model.weight.detach().numpy().T, w, atol=0.1)
    assert float(plain.model.weight.detach().abs().max()) < 0.3


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_class_weights_in_the_loss_module_reach_the_trainers(client: Client, digits: tuple,
                                                             strategy: str) -> None:
    # Class 3 weighs nothing: its samples never pull its score up, so it is (almost) never
    # predicted, while the other classes are learned as usual.
    X, y, (xv, yv) = digits
    weight = torch.ones(10)
    weight[3] = 0.0
    result = dt.Trainer(bn_mlp(), loss=torch.nn.CrossEntropyLoss(weight=weight), strategy=strategy,
                        lr=3e-3, batch_size=64, epochs=1, score_every=0.5, progress=False,
                        client=client).fit(X, y, validation=(xv, yv))
    model = result.model.eval()
    with torch.no_grad():
        predicted = model(torch.from_numpy(xv)).argmax(1).numpy()
    recall_3 = float((predicted[yv == 3] == 3).mean())
    others = float((predicted[yv != 3] == yv[yv != 3]).mean())
    assert recall_3 < 0.2 and others > 0.85


@pytest.mark.parametrize(("strategy", "precision"),
                         [("async-ps", True), ("sync", "bf16"), ("async-ps", "fp16")])
def test_mixed_precision_trains_on_the_cpu(client: Client, digits: tuple, strategy: str,
                                           precision: bool | str) -> None:
    X, y, validation = digits
    result = dt.Trainer(bn_mlp(), strategy=strategy, lr=3e-3, batch_size=64, epochs=1,
                        score_every=0.5, mixed_precision=precision, progress=False,
                        client=client).fit(X, y, validation=validation)
    # One asynchronous epoch ends at 0.89-0.95 from run to run (staleness); chance is 0.1.
    assert result.history["accuracy"].iloc[-1] > 0.85
    # Parameters stay float32: autocast changes the forward pass only.
    assert all(p.dtype == torch.float32 for p in result.model.parameters())


def test_device_settings_are_checked_before_any_work(client: Client, digits: tuple) -> None:
    X, y, validation = digits
    with pytest.raises(dt.InvalidInput) as info:
        dt.Trainer(bn_mlp(), device="tpu", mixed_precision="fp8", client=client).fit(X, y)
    message = str(info.value)
    assert "device='tpu'" in message and "mixed_precision='fp8'" in message
    if torch.cuda.is_available():
        return  # the CPU-only refusal below needs workers without a GPU
    with pytest.raises(dt.InvalidInput, match="have no CUDA device"):
        dt.Trainer(bn_mlp(), device="cuda", progress=False, client=client).fit(
            X, y, validation=validation)


def test_sample_weight_problems_name_the_fix(client: Client, digits: tuple) -> None:
    X, y, _ = digits

    def two_arguments(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, target)

    with pytest.raises(dt.InvalidInput) as info:
        dt.Trainer(bn_mlp(), loss=two_arguments, client=client).fit(
            X, y, sample_weight=np.ones(5, dtype=np.float32))
    message = str(info.value)
    assert "one weight per row of X" in message and "cannot weigh samples" in message


def test_connect_as_a_context_manager_closes_the_embedded_cluster() -> None:
    with dt.connect(n_workers=1, dashboard=False, quiet=True) as client:
        cluster = client.cluster
        assert client.submit(sum, [1, 2]).result(timeout=30) == 3
    assert client.status == "closed" and cluster.status.name == "closed"


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_a_dask_validation_set_is_scored_where_its_blocks_live(client: Client, digits: tuple,
                                                               strategy: str) -> None:
    X, y, (xv, yv) = digits

    def top2(out: torch.Tensor, target: torch.Tensor) -> float:
        return float((out.topk(2, dim=1).indices == target[:, None]).any(dim=1).float().mean())

    spread = (da.from_array(xv, chunks=(90, 64)), da.from_array(yv, chunks=90))  # 4 blocks
    result = dt.Trainer(bn_mlp(), strategy=strategy, lr=3e-3, batch_size=64, epochs=1,
                        score_every=0.5, metrics={"top2": top2}, progress=False,
                        client=client).fit(X, y, validation=spread)
    # Evaluated on both workers, every row once; never gathered into one process.
    assert len(result.validation_rows) == 2 and sum(result.validation_rows.values()) == len(yv)
    last = result.history.iloc[-1]
    model = result.model.eval()
    with torch.no_grad():
        out = model(torch.from_numpy(xv))
        loss = float(torch.nn.functional.cross_entropy(out, torch.from_numpy(yv)))
    assert last["accuracy"] == pytest.approx(float((out.argmax(1).numpy() == yv).mean()))
    assert last["top2"] == pytest.approx(top2(out, torch.from_numpy(yv)))
    assert last["loss"] == pytest.approx(loss, rel=1e-5)
    # Failed once in 3 loaded runs (0.95-0.96 in 8 others): say what the job went through.
    assert last["accuracy"] > 0.9, (result.history.to_dict("records"), result.failures,
                                     result.trainers, result.stopped_by)
