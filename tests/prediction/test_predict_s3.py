"""dt.predict from object storage to object storage (issue 27): rows read from a zarr store and a
Parquet table on a local S3 server (moto), the predictions written back there by the workers,
which have no credentials of their own (the storage options travel with the graph), and read
back equal to a plain torch forward pass over the same rows."""

from __future__ import annotations

from typing import Any

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import torch
from distributed import Client, get_task_stream

import dask_train as dt
from dask_train.data._cluster import live_workers


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _rows(n: int = 2_000) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(n, 8)).astype(np.float32)


def _reference(net: torch.nn.Module, x: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(net(torch.from_numpy(x)), dim=1)


def test_predictions_of_a_zarr_store_on_s3_are_written_back_to_s3(
        client: Client, s3: dict[str, Any]) -> None:
    import zarr

    x = _rows()
    store = zarr.create_array("s3://train/predict/x.zarr", shape=x.shape, chunks=(250, 8),
                              dtype=x.dtype, storage_options=s3)
    store[:] = x
    net = _net()
    X = da.from_zarr("s3://train/predict/x.zarr", storage_options=s3)
    probabilities = dt.predict(net, X, method="softmax")
    with get_task_stream(client) as tasks:
        probabilities.to_zarr("s3://train/predict/p.zarr", storage_options=s3)
    # The chunks were written by tasks on the workers, with the options the graph carries.
    writers = {t["worker"] for t in tasks.data if "store" in str(t["key"])}
    assert writers and writers <= set(live_workers(client))
    back = zarr.open_array("s3://train/predict/p.zarr", mode="r", storage_options=s3)
    assert back.shape == (2_000, 3) and back.chunks == (250, 3)
    torch.testing.assert_close(torch.from_numpy(back[:]), _reference(net, x))


def test_predictions_of_a_parquet_table_on_s3_are_written_back_as_a_column(
        client: Client, s3: dict[str, Any]) -> None:
    x = _rows()
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(8)])
    frame["id"] = np.arange(len(frame))
    dd.from_pandas(frame, npartitions=4).to_parquet("s3://train/predict/rows.parquet",
                                                    storage_options=s3)
    net = _net()
    rows = dd.read_parquet("s3://train/predict/rows.parquet", storage_options=s3)
    rows["label"] = dt.predict(net, rows[[f"f{i}" for i in range(8)]], method="argmax")
    rows[["id", "label"]].to_parquet("s3://train/predict/labels.parquet", storage_options=s3)
    back = pd.read_parquet("s3://train/predict/labels.parquet", storage_options=s3)
    back = back.sort_values("id")
    assert back["id"].tolist() == list(range(2_000))
    expected = _reference(net, x).argmax(1).numpy()
    np.testing.assert_array_equal(back["label"].to_numpy(), expected)
