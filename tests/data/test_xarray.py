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


def _xbatcher_patches(a: np.ndarray, size: int, overlap: int) -> np.ndarray:
    """Patches of ``a`` (time, lat, lon) as xbatcher's BatchGenerator cuts them with
    ``input_dims={"lat": size, "lon": size}, input_overlap={"lat": overlap, "lon": overlap}``:
    starts every ``size - overlap``, a patch that would run past the end left out; one sample a
    (time, lat start, lon start), in that order."""
    starts = [s for s in range(0, a.shape[1], size - overlap) if s + size <= a.shape[1]]
    return np.stack([a[t, i : i + size, j : j + size]
                     for t in range(a.shape[0]) for i in starts for j in starts])


def _field_store(root: Path) -> xr.Dataset:
    rng = np.random.default_rng(1)
    field = rng.normal(size=(200, 16, 16)).astype(np.float32)
    ds = xr.Dataset({"field": (("time", "lat", "lon"), field),
                     "wind": (("time", "lat", "lon"), -field)})
    ds.chunk({"time": 50}).to_zarr(root / "fields.zarr")
    return xr.open_zarr(root / "fields.zarr")


def test_patches_are_cut_as_xbatcher_cuts_them(tmp_path: Path) -> None:
    ds = _field_store(tmp_path)
    patched = dt.patches(ds["field"], {"lat": 8, "lon": 8}, {"lat": 4, "lon": 4})
    assert patched.dims == ("sample", "lat_patch", "lon_patch")
    assert hasattr(patched.data, "dask")  # nothing read yet
    assert patched.data.chunks[0] == (450,) * 4  # a block: the 9 patches of 50 times
    expected = _xbatcher_patches(ds["field"].values, 8, 4)
    np.testing.assert_array_equal(patched.values, expected)
    # A Dataset's variables are cut alike and become features side by side.
    rows, _ = from_xarray(dt.patches(ds, {"lat": 8, "lon": 8}, {"lat": 4, "lon": 4}), None)
    np.testing.assert_array_equal(rows.compute(), np.concatenate(
        [expected.reshape(len(expected), -1), -expected.reshape(len(expected), -1)], axis=1))
    # Without overlap, as xbatcher's default.
    np.testing.assert_array_equal(dt.patches(ds["field"], {"lat": 8, "lon": 8}).values,
                                  _xbatcher_patches(ds["field"].values, 8, 0))


def test_patches_of_a_store_train_streamed_as_the_same_patches_in_memory(
        client: Client, tmp_path: Path) -> None:
    ds = _field_store(tmp_path)
    X = dt.patches(ds["field"], {"lat": 8, "lon": 8}, {"lat": 4, "lon": 4})
    y = (X.mean(["lat_patch", "lon_patch"]) > 0).astype(np.int64)  # lazy, one label a patch
    x = _xbatcher_patches(ds["field"].values, 8, 4).reshape(-1, 64)
    label = (x.mean(axis=1) > 0).astype(np.int64)

    def exact() -> dt.Trainer:
        torch.manual_seed(0)
        return dt.Trainer(torch.nn.Linear(64, 2), lr=1e-2, ps=1, workers=1, scorer=0,
                          batch_size=32, epochs=2, prefetch=0, seed=3, progress=False,
                          client=client)

    streamed = exact().fit(X, y, data="stream")
    plain = exact().fit(da.from_array(x, chunks=(450, 64)), da.from_array(label, chunks=450),
                        data="persist")
    torch.testing.assert_close(_flat(streamed.model), _flat(plain.model), rtol=0, atol=1e-6)
    assert streamed.ledger.groupby("epoch")["consumed"].sum().tolist() == [1_800, 1_800]
    assert streamed.trainers[0]["read_s"] > 0  # cut where its blocks were read, on the worker


def test_bad_patches_are_all_named_at_once(tmp_path: Path) -> None:
    ds = _field_store(tmp_path)
    with pytest.raises(dt.InvalidInput) as info:
        dt.patches(ds.assign(mask=(("lat", "lon"), np.ones((16, 16)))),
                   {"lat": 32, "height": 2}, {"lat": 40, "lon": 1}, sample_dim="time")
    text = str(info.value)
    assert "input_dims: 'height' is not a dimension of the data" in text
    assert "input_dims['lat']=32 is invalid: use an integer from 1 to the dimension's size, 16" \
        in text
    assert "input_overlap: 'lon' is not in input_dims" in text
    assert "the data already has a dimension 'time': pass another sample_dim=" in text
    assert "the variable 'mask' ('lat', 'lon') lacks ['time']" in text
    with pytest.raises(dt.InvalidInput, match="input_dims={} is empty"):
        dt.patches(ds["field"], {})
