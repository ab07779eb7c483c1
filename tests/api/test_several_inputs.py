"""Several inputs per row: ``X`` as a dict of dask arrays passed to ``forward(**batch)``, the
README's tabular example (categorical columns through embeddings beside numeric columns)."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client
from torch import nn

import dask_train as dt

CARDINALITY = (12, 5)


def tabular(n: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Two categorical columns and three numeric ones; the class depends on both kinds."""
    rng = np.random.default_rng(seed)
    cat = np.stack([rng.integers(0, c, size=n) for c in CARDINALITY], axis=1).astype(np.int64)
    num = rng.normal(size=(n, 3)).astype(np.float32)
    y = ((cat[:, 0] % 3 == 0) ^ (num[:, 0] > 0)).astype(np.int64) + 2 * (cat[:, 1] > 2)
    return {"cat": cat, "num": num}, y


class Tabular(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.ModuleList(nn.Embedding(c, 4) for c in CARDINALITY)
        self.mlp = nn.Sequential(nn.Linear(4 * len(CARDINALITY) + 3, 32), nn.ReLU(),
                                 nn.Linear(32, 4))

    def forward(self, cat: torch.Tensor, num: torch.Tensor) -> torch.Tensor:
        parts = [e(cat[:, i]) for i, e in enumerate(self.embed)]
        return self.mlp(torch.cat([*parts, num], dim=1))


@pytest.fixture(scope="module")
def data() -> tuple:
    x, y = tabular(12_000, 0)
    X = {k: da.from_array(v, chunks=(3_000, *v.shape[1:])) for k, v in x.items()}
    return X, da.from_array(y, chunks=3_000), x, y, tabular(2_000, 1)


def _accuracy(module: nn.Module, x: dict, y: np.ndarray) -> float:
    module.eval()
    with torch.no_grad():
        out = module(**{k: torch.from_numpy(v) for k, v in x.items()})
    return float((out.argmax(1).numpy() == y).mean())


def _plain_torch(x: dict, y: np.ndarray, *, batch: int, epochs: int) -> nn.Module:
    torch.manual_seed(0)
    net = Tabular()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    xt = {k: torch.from_numpy(v) for k, v in x.items()}
    yt = torch.from_numpy(y)
    for _ in range(epochs):
        order = torch.randperm(len(yt))
        for i in range(0, len(yt), batch):
            idx = order[i : i + batch]
            opt.zero_grad()
            nn.functional.cross_entropy(net(**{k: v[idx] for k, v in xt.items()}), yt[idx]).backward()
            opt.step()
    return net


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_a_tabular_model_with_embeddings_trains_on_a_dict_of_inputs(client: Client, data: tuple,
                                                                    strategy: str) -> None:
    X, y, x, yy, (xv, yv) = data
    reference = _accuracy(_plain_torch(x, yy, batch=128 if strategy == "sync" else 64, epochs=2),
                          xv, yv)
    torch.manual_seed(0)
    result = dt.Trainer(Tabular(), strategy=strategy, workers=2, lr=1e-2, batch_size=64, epochs=2,
                        progress=False, client=client,
                        # one push at a time: staleness that load cannot grow
                        prefetch=strategy == "sync").fit(X, y, validation=(xv, yv))
    got = _accuracy(result.model, xv, yv)
    assert got >= reference - (0.1 if strategy == "async-ps" else 0.05), (got, reference)
    assert got == pytest.approx(float(result.history["accuracy"].iloc[-1]), abs=1e-6)
    # Every row of every epoch read once, as for a single input.
    assert result.ledger.groupby("epoch")["rows"].sum().tolist() == [len(yy)] * 2
    labels = dt.predict(result.model, {k: da.from_array(v, chunks=500) for k, v in xv.items()},
                        method="argmax").compute()
    assert float((labels == yv).mean()) == pytest.approx(got)


def test_inputs_of_different_lengths_are_refused_by_name(client: Client, data: tuple) -> None:
    X, y, *_ = data
    bad = {"cat": X["cat"], "num": X["num"][:-5]}
    with pytest.raises(ValueError, match="the inputs of X have different numbers of rows"):
        dt.Trainer(Tabular(), workers=2, progress=False, client=client).fit(bad, y)


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_a_dataframes_column_groups_are_inputs(client: Client, data: tuple, strategy: str) -> None:
    import dask.dataframe as dd
    import pandas as pd

    _, _, x, yy, (xv, yv) = data
    frame = pd.DataFrame({"cat0": x["cat"][:, 0], "cat1": x["cat"][:, 1],
                          # float64 columns, as pandas makes them: cast to the parameters' dtype
                          **{f"num{i}": x["num"][:, i].astype(np.float64) for i in range(3)},
                          "label": yy})
    df = dd.from_pandas(frame, npartitions=4)
    X = {"cat": df[["cat0", "cat1"]], "num": df[["num0", "num1", "num2"]]}
    reference = _accuracy(_plain_torch(x, yy, batch=128 if strategy == "sync" else 64, epochs=2),
                          xv, yv)
    torch.manual_seed(0)
    result = dt.Trainer(Tabular(), strategy=strategy, workers=2, lr=1e-2, batch_size=64,
                        epochs=2, progress=False, client=client, prefetch=strategy == "sync"
                        ).fit(X, df["label"], validation=(xv, yv))
    got = _accuracy(result.model, xv, yv)
    assert got >= reference - (0.1 if strategy == "async-ps" else 0.05), (got, reference)
    labels = dt.predict(result.model, X, method="argmax").compute()
    assert float((labels == yy).mean()) >= got - 0.05  # the training rows, in the frame's order
