"""xarray inputs (issue 27): a dask-backed Dataset from a zarr store trains as the same rows
given as dask arrays would: the sample dimension is y's, the other dimensions are features and
the variables are stacked side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
import pytest
import torch
import xarray as xr
from distributed import Client

import dask_train as dt
from dask_train.data._xarray import from_xarray


def _dataset(root: Path) -> tuple[xr.Dataset, xr.DataArray, np.ndarray, np.ndarray]:
    """Two variables over (time, station) and one over time, written to zarr and reopened;
    the same rows as plain arrays (the variables' columns side by side)."""
    rng = np.random.default_rng(0)
    t2m = rng.normal(size=(3_000, 3)).astype(np.float32)
    wind = rng.normal(size=(3_000, 3)).astype(np.float32)
    hour = rng.normal(size=3_000).astype(np.float32)
    label = (t2m[:, 0] + wind[:, 1] - hour > 0).astype(np.int64)
    ds = xr.Dataset({"t2m": (("time", "station"), t2m), "wind": (("station", "time"), wind.T),
                     "hour": (("time",), hour), "label": (("time",), label)})
    ds.chunk({"time": 500}).to_zarr(root / "weather.zarr")
    opened = xr.open_zarr(root / "weather.zarr")
    x = np.concatenate([t2m, wind, hour[:, None]], axis=1)
    return opened[["t2m", "wind", "hour"]], opened["label"], x, label


def _exact(client: Client) -> dt.Trainer:
    torch.manual_seed(0)
    return dt.Trainer(torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.ReLU(),
                                          torch.nn.Linear(16, 2)),
                      lr=1e-2, ps=1, workers=1, scorer=0, batch_size=32, epochs=2, prefetch=0,
                      seed=3, progress=False, client=client)


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def test_a_zarr_dataset_trains_as_its_rows(client: Client, tmp_path: Path) -> None:
    X, y, x, label = _dataset(tmp_path)
    rows, target = from_xarray(X, y)
    # Lazy still (nothing read), one row per time, the variables' columns side by side.
    assert hasattr(rows, "dask") and rows.shape == (3_000, 7) and target.shape == (3_000,)
    np.testing.assert_array_equal(rows.compute(), x)  # "wind" came transposed: time first
    streamed = _exact(client).set_params(scorer=1).fit(X, y, data="stream",
                                  validation=(X.isel(time=slice(0, 500)), y[:500]))
    plain = _exact(client).fit(da.from_array(x, chunks=(500, 7)), da.from_array(label, chunks=500),
                               data="persist")
    torch.testing.assert_close(_flat(streamed.model), _flat(plain.model), rtol=0, atol=1e-6)
    assert streamed.ledger.groupby("epoch")["consumed"].sum().tolist() == [3_000, 3_000]
    assert streamed.history["accuracy"].iloc[-1] > 0.9


def test_a_variable_without_the_sample_dimension_is_named(tmp_path: Path) -> None:
    X, y, _, _ = _dataset(tmp_path)
    bad: Any = X.assign(elevation=(("station",), np.arange(3.0)))
    with pytest.raises(dt.InvalidInput) as info:
        from_xarray(bad, y)
    assert "'elevation' ('station',)" in str(info.value) and "'time'" in str(info.value)
