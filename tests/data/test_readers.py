"""Training data reaches the workers without passing through the client or the graph:
``dt.from_npy`` reads blocks on the workers, numpy given to ``fit`` is scattered in blocks, and
blocks end up spread evenly over the workers."""

from __future__ import annotations

import pickle
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt
from dask_train.data._blocks import persist_blocks, scatter_blocks
from dask_train.data._cluster import live_workers


def test_from_npy_reads_several_files_by_block_on_the_workers(client: Client,
                                                             tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(n, 5)).astype(np.float32) for n in (1_000, 600)]
    paths = []
    for i, part in enumerate(parts):
        paths.append(tmp_path / f"part-{i}.npy")
        np.save(paths[-1], part)
    X = dt.from_npy(paths, block_rows=300)
    assert X.shape == (1_600, 5) and X.dtype == np.float32
    assert X.chunks[0] == (300, 300, 300, 100, 300, 300)
    # The graph holds file names and row ranges, never the data (1,600 x 5 floats = 32 KB).
    assert len(pickle.dumps(dict(X.__dask_graph__()))) < 16_000
    np.testing.assert_array_equal(X.compute(), np.concatenate(parts))


def test_from_npy_names_the_bad_file_and_argument(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.zeros((4, 3), np.float32))
    np.save(tmp_path / "b.npy", np.zeros((4, 2), np.float32))
    (tmp_path / "c.npy").write_text("not numpy")
    with pytest.raises(dt.InvalidInput, match="c.npy"):
        dt.from_npy([tmp_path / "a.npy", tmp_path / "c.npy"])
    with pytest.raises(dt.InvalidInput) as info:
        dt.from_npy([tmp_path / "a.npy", tmp_path / "b.npy"], block_rows=0)
    assert "must agree past the first axis" in str(info.value) and "block_rows=0" in str(info.value)


def _spread(client: Client, futures: list) -> Counter:
    who_has = client.who_has(futures)
    return Counter(sorted(who_has[f.key])[0] for f in futures)


def test_blocks_are_spread_evenly_however_dask_placed_them(client: Client) -> None:
    # All blocks computed on one worker first (a restriction), as an unlucky placement would.
    first = sorted(live_workers(client))[0]
    X, y = dt.datasets.digits(8_000, seed=0, chunks=1_000)
    X, y = client.persist([X, y], workers=[first])
    blocks = client.sync(persist_blocks, client, X, y)
    assert sorted(_spread(client, blocks.futures).values()) == [4, 4]
    assert [b.holders for b in blocks.blocks] == [(sorted(client.who_has([f])[f.key])[0],)
                                                  for f in blocks.futures]


def test_numpy_given_to_fit_is_scattered_in_blocks_not_embedded(client: Client) -> None:
    X, y = client.compute(dt.datasets.digits(40_000, seed=0), sync=True)  # in memory, 10 MB
    blocks = client.sync(scatter_blocks, client, X, y, block_rows=10_000)
    assert len(blocks.futures) == 16 and sorted(_spread(client, blocks.futures).values()) == [8, 8]
    np.testing.assert_array_equal(client.gather(blocks.futures[1])[0], X[2_500:5_000])
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "Sending large graph" is a UserWarning
        result = dt.Trainer(net, lr=3e-3, batch_size=64, epochs=1, progress=False,
                            client=client).fit(X, y, validation=dt.datasets.digits_test())
    assert result.samples == 40_000 and result.history["accuracy"].iloc[-1] > 0.8
    # Read where they were sent, but for the epoch's tail: a trainer out of blocks takes one
    # of the other worker's rather than idle.
    assert result.ledger["local"].mean() >= 0.75
