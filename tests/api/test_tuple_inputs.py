"""Several inputs by position: ``X=(num, tok)`` reaches ``forward(num, tok)``, in training,
scoring (in the scorer or where the validation blocks live), ``dt.predict`` and ``dt.search``;
a metric function gets the model's whole output (here a tuple) and picks what it needs."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client
from torch import nn

import dask_train as dt

VOCAB, N_CLASSES = 8, 4


def pairs(n: int, seed: int) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """Numeric features (float64, as numpy makes them) and token ids; the class needs both."""
    rng = np.random.default_rng(seed)
    num = rng.normal(size=(n, 6))
    tok = rng.integers(0, VOCAB, size=(n, 3))
    y = (num[:, 0] + num[:, 1] > 0).astype(np.int64) + 2 * (tok[:, 0] % 2)
    return (num, tok), y


class PairNet(nn.Module):
    """Positional-only inputs (a call by name fails); returns (logits, hidden) as an RNN does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.body = nn.Sequential(nn.Linear(6 + 3 * 4, 32), nn.ReLU())
        self.head = nn.Linear(32, N_CLASSES)

    def forward(self, num: torch.Tensor, tok: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(torch.cat([num, self.embed(tok).flatten(1)], dim=1))
        return self.head(h), h


def first_accuracy(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> float:
    """A metric of the whole output: it picks the logits (the tuple's first element) itself."""
    return float((out[0].argmax(1) == target).float().mean())


def _tensors(x: tuple[np.ndarray, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(x[0].astype(np.float32)), torch.from_numpy(x[1])


def _accuracy(module: nn.Module, x: tuple, y: np.ndarray) -> float:
    module.eval()
    with torch.no_grad():
        return float((module(*_tensors(x))[0].argmax(1).numpy() == y).mean())


def _plain_torch(x: tuple, y: np.ndarray, *, batch: int, epochs: int) -> nn.Module:
    torch.manual_seed(0)
    net = PairNet()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    (num, tok), yt = _tensors(x), torch.from_numpy(y)
    for _ in range(epochs):
        order = torch.randperm(len(yt))
        for i in range(0, len(yt), batch):
            idx = order[i : i + batch]
            opt.zero_grad()
            nn.functional.cross_entropy(net(num[idx], tok[idx])[0], yt[idx]).backward()
            opt.step()
    return net


@pytest.fixture(scope="module")
def data() -> tuple:
    return pairs(10_000, 0), pairs(2_000, 1)


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_a_tuple_of_inputs_reaches_forward_by_position(client: Client, data: tuple,
                                                       strategy: str) -> None:
    (x, y), (xv, yv) = data
    reference = _accuracy(_plain_torch(x, y, batch=128 if strategy == "sync" else 64, epochs=2),
                          xv, yv)
    if strategy == "sync":  # dask inputs in different row chunks, validation left on the cluster
        X = (da.from_array(x[0], chunks=(2_500, 6)), da.from_array(x[1], chunks=(2_000, 3)))
        yd = da.from_array(y, chunks=2_500)
        validation: tuple = ((da.from_array(xv[0], chunks=500), da.from_array(xv[1], chunks=500)),
                             da.from_array(yv, chunks=500))
    else:  # in memory: scattered in blocks, scored in the scorer's process
        X, yd, validation = x, y, (xv, yv)
    torch.manual_seed(0)
    result = dt.Trainer(PairNet(), strategy=strategy, workers=2, lr=1e-2, batch_size=64,
                        epochs=2, metrics={"first": first_accuracy}, progress=False,
                        client=client,
                        # one push at a time: staleness that load cannot grow
                        prefetch=strategy == "sync").fit(X, yd, validation=validation)
    got = _accuracy(result.model, xv, yv)
    assert got >= reference - (0.1 if strategy == "async-ps" else 0.05), (got, reference)
    last = result.history.iloc[-1]
    assert last["accuracy"] == pytest.approx(got, abs=1e-6)
    assert last["first"] == pytest.approx(got, abs=1e-6)  # the metric read the tuple's logits
    assert result.ledger.groupby("epoch")["rows"].sum().tolist() == [len(y)] * 2
    labels = dt.predict(result.model, (da.from_array(xv[0], chunks=700),
                                       da.from_array(xv[1], chunks=700)), method="argmax")
    assert labels.chunks[0] == (700, 700, 600)
    assert float((labels.compute() == yv).mean()) == pytest.approx(got)
    hidden = dt.predict(result.model, xv, output=lambda out: out[1]).compute()
    assert hidden.shape == (len(yv), 32)


def test_tuple_inputs_that_do_not_line_up_are_refused_before_any_work(client: Client,
                                                                      data: tuple) -> None:
    (x, y), (xv, yv) = data
    num, tok = da.from_array(x[0], chunks=2_500), da.from_array(x[1], chunks=2_500)
    trainer = dt.Trainer(PairNet(), workers=2, progress=False, client=client)
    with pytest.raises(dt.InvalidInput) as shorter:
        trainer.fit((num, tok[:-5]), y)
    assert "the inputs of X have different numbers of rows: {'X[0]': 10000, 'X[1]': 9995}" \
        in str(shorter.value)
    with pytest.raises(dt.InvalidInput) as unknown:
        trainer.fit((num[num[:, 0] > -100], tok), y)  # a filter leaves the row counts unknown
    assert "X[0] has unknown chunk sizes: call compute_chunk_sizes()" in str(unknown.value)
    with pytest.raises(dt.InvalidInput) as fewer:
        trainer.fit((num, tok), y, validation=((xv[0],), yv))
    assert "validation X_val holds X_val[0] (6,) but X holds X[0] (6,), X[1] (3,)" \
        in str(fewer.value)
    with pytest.raises(dt.InvalidInput, match="X has the key '\\*num': keys starting with"):
        trainer.fit({"*num": num, "tok": tok}, y)
    with pytest.raises(dt.InvalidInput, match="the inputs of y have different numbers of rows"):
        trainer.fit((num, tok), {"a": y, "b": y[:10]})
    # A list of rows is still one array, as numpy reads it (not two inputs).
    with pytest.raises(dt.InvalidInput, match="module failed on a batch shaped like X \\(2, 2\\)"):
        trainer.fit([[0.0, 1.0], [1.0, 0.0]], [0, 1])


def test_a_search_over_a_model_with_tuple_inputs(client: Client, data: tuple) -> None:
    (x, y), (xv, yv) = data
    reference = _accuracy(_plain_torch(x, y, batch=64, epochs=1), xv, yv)
    X = (da.from_array(x[0], chunks=2_500), da.from_array(x[1], chunks=2_500))
    trainer = dt.Trainer(PairNet, workers=1, epochs=1, lr=1e-2, batch_size=64, progress=False,
                         client=client)
    found = dt.search(trainer, {"batch_size": [32, 64]}, X, y, validation=(xv, yv),
                      n_trials=2, pruner=None, progress=False, client=client)
    assert len(found.trials) == 2 and set(found.trials["state"]) == {"complete"}
    assert isinstance(found.best_model, PairNet)
    assert _accuracy(found.best_model, xv, yv) == pytest.approx(found.best_score, abs=1e-6)
    assert found.best_score >= reference - 0.1, (found.best_score, reference)
