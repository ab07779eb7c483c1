"""Several targets: ``y`` as a dict of arrays (a class label and a regression target for a model
with two heads), read by a loss function of yours; metric functions get the model's whole
output (a dict) and the whole target (a dict) and pick what they need."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client
from torch import nn

import dask_train as dt

N_CLASSES = 4


def two_tasks(n: int, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Features, a class from a fixed linear map and a smooth regression target of them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 10)).astype(np.float32)
    w = np.random.default_rng(99).normal(size=(10, N_CLASSES))
    value = 2 * x[:, 0] - x[:, 1] + np.sin(x[:, 2]) + 0.1 * rng.normal(size=n)
    return x, {"label": (x @ w).argmax(1).astype(np.int64), "value": value.astype(np.float32)}


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.label = nn.Linear(32, N_CLASSES)
        self.value = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        return {"label": self.label(h), "value": self.value(h).squeeze(1)}


def both(out: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> torch.Tensor:
    return (nn.functional.cross_entropy(out["label"], target["label"])
            + nn.functional.mse_loss(out["value"], target["value"]))


def label_accuracy(out: dict, target: dict) -> float:
    return float((out["label"].argmax(1) == target["label"]).float().mean())


def value_mae(out: dict, target: dict) -> float:
    return float((out["value"] - target["value"]).abs().mean())


def _scores(module: nn.Module, x: np.ndarray, y: dict) -> tuple[float, float]:
    module.eval()
    with torch.no_grad():
        out = module(torch.from_numpy(x))
    target = {k: torch.from_numpy(v) for k, v in y.items()}
    return label_accuracy(out, target), value_mae(out, target)


def _plain_torch(x: np.ndarray, y: dict, *, batch: int, epochs: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = TwoHeads()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    xt, yt = torch.from_numpy(x), {k: torch.from_numpy(v) for k, v in y.items()}
    for _ in range(epochs):
        order = torch.randperm(len(xt))
        for i in range(0, len(xt), batch):
            idx = order[i : i + batch]
            opt.zero_grad()
            both(net(xt[idx]), {k: v[idx] for k, v in yt.items()}).backward()
            opt.step()
    return net


@pytest.fixture(scope="module")
def data() -> tuple:
    return two_tasks(10_000, 0), two_tasks(2_000, 1)


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_two_heads_train_on_a_dict_of_targets(client: Client, data: tuple, strategy: str) -> None:
    (x, y), (xv, yv) = data
    # The reference is the worst of three plain torch runs: with Adam at lr=1e-2 the final
    # step's noise alone moves one run's MAE from 0.20 to 0.25 (and an async run's more).
    refs = [_scores(_plain_torch(x, y, batch=128 if strategy == "sync" else 64, epochs=2,
                                 seed=seed), xv, yv) for seed in range(3)]
    ref_acc, ref_mae = min(r[0] for r in refs), max(r[1] for r in refs)
    X = da.from_array(x, chunks=(2_500, 10))
    yd = {k: da.from_array(v, chunks=2_500) for k, v in y.items()}
    # sync: the validation set stays on the cluster, its outputs gathered for the metrics;
    # async-ps: in memory, scored in the scorer's process.
    validation: tuple = (da.from_array(xv, chunks=500),
                         {k: da.from_array(v, chunks=500) for k, v in yv.items()}) \
        if strategy == "sync" else (xv, yv)
    torch.manual_seed(0)
    result = dt.Trainer(TwoHeads(), loss=both, strategy=strategy, workers=2, lr=1e-2,
                        batch_size=64, epochs=2, progress=False, client=client,
                        metrics={"acc": label_accuracy, "mae": value_mae},
                        stop=[dt.StopAtScore("mae", 0.0, mode="min")],  # a score it watches
                        # one push at a time: staleness that load cannot grow
                        prefetch=strategy == "sync").fit(X, yd, validation=validation)
    acc, mae = _scores(result.model, xv, yv)
    # async-ps ends at MAE 0.20-0.26 mostly, at 0.30 or more in 8 of 200 runs with a worker
    # stopped now and then (CI saw 0.405, 0.447 and 0.60): nothing is lost or applied twice
    # (every update replayed), the two trainers took turns at the end, each gradient one or
    # two updates old, and Adam at lr=1e-2 makes the value head swing on such gradients. Plain
    # torch with every gradient 1, 2 or 3 updates old ends at up to 0.38, 0.46, 0.53 (six seeds
    # each), so the bar is 3 times the reference: an untrained value head is off by about 1.8.
    run = (f"failures={result.failures} departures={result.departures} steps={result.steps} "
           f"trainers={[(t['trainer'], t['steps']) for t in result.trainers]}")
    assert acc >= ref_acc - (0.1 if strategy == "async-ps" else 0.05), (acc, ref_acc, run)
    assert mae <= ref_mae * (3.0 if strategy == "async-ps" else 1.25), (mae, ref_mae, run)
    last = result.history.iloc[-1]
    assert last["acc"] == pytest.approx(acc, abs=1e-6)
    assert last["mae"] == pytest.approx(mae, rel=1e-4)
    with torch.no_grad():
        whole = float(both(result.model(torch.from_numpy(xv)),
                           {k: torch.from_numpy(v) for k, v in yv.items()}))
    assert last["loss"] == pytest.approx(whole, rel=1e-4)  # the batches' means, weighted by rows
    assert result.ledger.groupby("epoch")["rows"].sum().tolist() == [len(x)] * 2
    value = dt.predict(result.model, X, output="value").compute()
    assert float(np.abs(value - y["value"]).mean()) < 2 * ref_mae + 0.1


def test_a_built_in_loss_or_a_metric_that_does_not_fit_is_refused_before_any_work(
        client: Client, data: tuple) -> None:
    (x, y), (xv, yv) = data
    X, yd = da.from_array(x, chunks=2_500), {k: da.from_array(v, chunks=2_500) for k, v in y.items()}

    def fit(**options: object) -> None:
        dt.Trainer(TwoHeads(), workers=2, progress=False, client=client,
                   **{"loss": both, **options}).fit(X, yd, validation=(xv, yv))

    for loss in ("cross_entropy", nn.MSELoss()):
        with pytest.raises(dt.InvalidInput) as named:
            fit(loss=loss)
        assert "reads one target tensor, but y holds several (y['label'], y['value']): pass a " \
            "function loss=fn(output, target)" in str(named.value)
    with pytest.raises(dt.InvalidInput) as missing:
        fit(metrics={"top": lambda out, target: (out["scores"].argmax(1) == target).mean()})
    message = str(missing.value)
    assert "metrics['top'] failed on the module's output dict {'label': (2, 4), 'value': (2,)}" \
        in message and "KeyError: 'scores'" in message and "picks what it needs" in message
    with pytest.raises(dt.InvalidInput, match="metrics\\['both'\\] returned dict .*return a number"):
        fit(metrics={"both": lambda out, target: out})
    with pytest.raises(dt.InvalidInput) as plain:  # validation targets: the same dict as y's
        dt.Trainer(TwoHeads(), loss=both, workers=2, progress=False, client=client).fit(
            X, yd, validation=(xv, yv["label"]))
    assert "validation y_val holds one array with rows shaped () but y holds y['label'] (), " \
        "y['value'] ()" in str(plain.value)
