"""dt.predict on the session cluster: outputs, alignment, frames, estimators, and the model sent
once per worker (counted where it is unpickled)."""

from __future__ import annotations

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import torch
from distributed import Client
from sklearn.linear_model import LogisticRegression

import dask_train as dt
from dask_train.errors import InvalidInput

# How often this process unpickled a CountingNet. The class is pickled by reference (this module
# is importable in the workers, which inherit the test run's sys.path), so each worker process
# has one counter whichever thread unpickles: a task, or the event loop reading a task's spec.
UNPICKLED = {"n": 0}


class CountingNet(torch.nn.Module):
    """An MLP that counts how often it is unpickled in the process that unpickles it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        UNPICKLED["n"] += 1


def read_unpickled() -> int:
    return UNPICKLED["n"]


def reset_unpickled() -> None:
    UNPICKLED["n"] = 0


def _unpickles(client: Client) -> dict[str, int]:
    return client.run(read_unpickled)


def _reset(client: Client) -> None:
    client.run(reset_unpickled)


@pytest.fixture
def X() -> da.Array:
    rng = np.random.default_rng(0)
    return da.from_array(rng.normal(size=(2_000, 8)).astype(np.float32), chunks=(100, 8))


def test_torch_outputs_match_the_model_block_for_block(client: Client, X: da.Array) -> None:
    net = CountingNet()
    p = dt.predict(net, X, batch_size=32)
    assert p.chunks == (X.chunks[0], (3,))
    expected = net(torch.from_numpy(X.compute())).detach().numpy()
    np.testing.assert_allclose(p.compute(), expected, rtol=1e-5, atol=1e-6)
    labels = dt.predict(net, X, method="argmax").compute()
    np.testing.assert_array_equal(labels, expected.argmax(axis=1))
    assert net.training  # the user's module was put back in its mode after the probe


def test_the_model_is_unpickled_at_most_once_per_worker(client: Client, X: da.Array) -> None:
    torch.manual_seed(123)  # other weights than the other tests' nets: a model the workers lack
    net = CountingNet()
    _reset(client)
    dt.predict(net, X).compute()  # 20 blocks on 2 workers
    counts = _unpickles(client)
    assert sum(counts.values()) >= 1
    assert max(counts.values()) <= 1, counts
    dt.predict(net, X, method="softmax").compute()  # the same model again: the workers keep it
    assert max(_unpickles(client).values()) <= 1
    # The reference: the model pickled into every task is unpickled once per block.
    _reset(client)
    X.map_blocks(lambda b, m: m(torch.from_numpy(b)).detach().numpy(), net, dtype=np.float32,
                 chunks=(X.chunks[0], (3,))).compute()
    assert sum(_unpickles(client).values()) >= X.numblocks[0]


def test_a_dataframe_gives_a_series_with_its_partitions_and_index(client: Client) -> None:
    rng = np.random.default_rng(1)
    frame = pd.DataFrame(rng.normal(size=(600, 3)), columns=["a", "b", "c"],
                         index=pd.RangeIndex(1_000, 1_600))
    target = (frame["a"] + frame["b"] > 0).astype(int)
    clf = LogisticRegression().fit(frame, target)
    df = dd.from_pandas(frame, npartitions=4)
    predicted = dt.predict(clf, df[["a", "b", "c"]])
    assert isinstance(predicted, dd.Series)
    assert predicted.npartitions == df.npartitions
    df["outcome"] = predicted
    result = df.compute()
    pd.testing.assert_index_equal(result.index, frame.index)
    np.testing.assert_array_equal(result["outcome"].to_numpy(), clf.predict(frame))
    proba = dt.predict(clf, df[["a", "b", "c"]], method="predict_proba").compute()
    assert list(proba.columns) == [0, 1]
    np.testing.assert_allclose(proba.to_numpy(), clf.predict_proba(frame))


def test_array_models_and_estimators_on_arrays(client: Client, X: da.Array) -> None:
    model = dt.softmax_regression(n_features=8, n_classes=3)
    labels = dt.predict(model, X).compute()
    assert labels.shape == (2_000,) and set(np.unique(labels)) <= {0, 1, 2}
    Xn = X.compute().astype(np.float64)
    clf = LogisticRegression().fit(Xn, (Xn[:, 0] > 0).astype(int))
    np.testing.assert_allclose(dt.predict(clf, X, method="predict_proba").compute(),
                               clf.predict_proba(Xn), rtol=1e-5)


def test_an_xarray_object_is_cut_into_rows_as_training_cuts_it(client: Client) -> None:
    import xarray as xr  # a dev dependency (pyproject), installed by make test

    rng = np.random.default_rng(2)
    values = da.from_array(rng.normal(size=(300, 2, 4)), chunks=(100, 2, 4))
    cube = xr.DataArray(values, dims=("time", "lat", "lon"))
    rows = values.reshape(300, 8).compute()  # one row per time, lat x lon features
    clf = LogisticRegression().fit(rows, (rows[:, 0] > 0).astype(int))
    predicted = dt.predict(clf, cube, method="predict_proba")
    assert isinstance(predicted, da.Array)
    assert predicted.chunks == ((100, 100, 100), (2,))
    np.testing.assert_allclose(predicted.compute(), clf.predict_proba(rows))


def test_bad_arguments_are_refused_before_anything_runs(client: Client, X: da.Array) -> None:
    net = CountingNet()
    with pytest.raises(InvalidInput) as info:
        dt.predict(net, X, method="predict_proba", batch_size=0)
    assert len(info.value.problems) == 2
    assert "batch_size=0" in info.value.problems[0]
    assert "'forward', 'argmax', 'softmax'" in info.value.problems[1]
    with pytest.raises(InvalidInput, match="failed on the first rows of X"):
        dt.predict(net, da.ones((10, 5), chunks=5, dtype=np.float32))  # 5 features, not 8
    with pytest.raises(InvalidInput, match="has no method 'transform'"):
        dt.predict(LogisticRegression(), X, method="transform")
