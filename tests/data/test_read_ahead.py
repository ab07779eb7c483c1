"""``blocks_ahead="auto"`` (issue 27): a trainer starved of streamed blocks is granted more of
them ahead, but only while its worker has room below Dask's memory target; a number given by the
user stays the bound. Real cluster, real zarr stores."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt
from dask_train.policy._data_mode import AUTO_BLOCKS_AHEAD, read_ahead
from dask_train.runtime._compat import room_below_target

ROWS, BLOCK = 3_000, 50  # blocks that train in about a millisecond: reads cannot keep up at 2


def _write_zarr(url: str, a: np.ndarray) -> None:
    import zarr

    z = zarr.create_array(url, shape=a.shape, chunks=(BLOCK, *a.shape[1:]), dtype=a.dtype,
                          compressors=None)
    z[:] = a


@pytest.fixture(scope="module")
def small_blocks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("small-blocks")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 8), dtype=np.float32)
    _write_zarr(str(root / "x.zarr"), x)
    _write_zarr(str(root / "y.zarr"), (x[:, 0] > 0).astype(np.int64))
    return {"x": str(root / "x.zarr"), "y": str(root / "y.zarr")}


def _slow_read(block: np.ndarray) -> np.ndarray:
    # A read that takes 20 ms, not CPU: whatever else loads the machine, a 50-row block trains
    # in far less, so a trainer granted two at a time waits for its blocks (it is starved).
    time.sleep(0.02)
    return block


def _fit(client: Client, store: dict[str, str], blocks_ahead: int | str) -> Any:
    X = da.from_zarr(store["x"]).map_blocks(_slow_read, dtype=np.float32)
    y = da.from_zarr(store["y"])
    return dt.Trainer(torch.nn.Linear(8, 2), workers=2, epochs=2, scorer=0, progress=False,
                      blocks_ahead=blocks_ahead, client=client).fit(X, y, data="stream")


def _once_per_epoch(result: Any) -> None:
    ledger = result.ledger
    assert not ledger.duplicated(["epoch", "block"]).any()
    assert ledger.groupby("epoch")["consumed"].sum().tolist() == [ROWS, ROWS]


def test_read_ahead_resolves_auto_and_numbers() -> None:
    assert read_ahead("auto") == AUTO_BLOCKS_AHEAD and AUTO_BLOCKS_AHEAD[0] < AUTO_BLOCKS_AHEAD[1]
    assert read_ahead(5) == (5, 5)


def test_starved_trainers_read_further_ahead_and_a_number_stays_the_bound(
        client: Client, small_blocks: dict[str, str]) -> None:
    auto = _fit(client, small_blocks, "auto")
    _once_per_epoch(auto)
    held = [t["held_blocks_max"] for t in auto.trainers]
    assert max(held) > AUTO_BLOCKS_AHEAD[0], held  # grew past the two it started with
    assert max(held) <= AUTO_BLOCKS_AHEAD[1], held
    fixed = _fit(client, small_blocks, 2)
    _once_per_epoch(fixed)
    assert [t["held_blocks_max"] <= 2 for t in fixed.trainers] == [True, True]


@pytest.fixture
def no_room(client: Client) -> Iterator[None]:
    """The session cluster's workers with their memory target set below what they already hold,
    as a worker near its limit is, then set back."""

    def set_target(fraction: float | None, dask_worker: Any) -> float:
        before = dask_worker.memory_manager.memory_target_fraction
        if fraction is not None:
            dask_worker.memory_manager.memory_target_fraction = fraction
        return before

    before = client.run(set_target, None)
    limits = client.run(lambda dask_worker: dask_worker.memory_manager.memory_limit)
    assert all(limits.values()), "the session cluster's workers have memory limits"
    client.run(set_target, 1e-6)
    try:
        yield
    finally:
        for address, fraction in before.items():
            client.run(set_target, fraction, workers=[address])


def test_a_worker_without_room_is_not_granted_more(
        client: Client, small_blocks: dict[str, str], no_room: None) -> None:
    rooms = client.run(lambda dask_worker: room_below_target(dask_worker))
    assert all(room < 0 for room in rooms.values())
    result = _fit(client, small_blocks, "auto")
    _once_per_epoch(result)
    assert [t["held_blocks_max"] <= 2 for t in result.trainers] == [True, True]


def test_room_below_target_is_what_the_process_may_still_grow(client: Client) -> None:
    def facts(dask_worker: Any) -> tuple[float, float, float]:
        manager = dask_worker.memory_manager
        return (room_below_target(dask_worker),
                manager.memory_target_fraction * manager.memory_limit,
                float(dask_worker.monitor.get_process_memory()))

    for room, target, used in client.run(facts).values():
        assert used > 0 and abs(room - (target - used)) < 64 * 2**20  # read moments apart


def _loop(ctx: Any) -> None:
    for _ in ctx.epochs(1):
        for _batch in ctx.batches("train"):
            pass


def test_a_bad_blocks_ahead_is_named_before_anything_runs(
        client: Client, small_blocks: dict[str, str]) -> None:
    X, y = da.from_zarr(small_blocks["x"]), da.from_zarr(small_blocks["y"])
    with pytest.raises(dt.InvalidInput, match=r"blocks_ahead=0 is invalid: use 'auto' or an "
                                              r"integer >= 1\."):
        dt.Trainer(torch.nn.Linear(8, 2), blocks_ahead=0, progress=False, client=client).fit(X, y)
    # The same words from dt.run: one check of the value, whichever door it came through.
    with pytest.raises(dt.InvalidInput, match=r"blocks_ahead='many' is invalid: use 'auto' or "
                                              r"an integer >= 1\."):
        dt.run(_loop, data={"train": (X, y)}, blocks_ahead="many", client=client)
