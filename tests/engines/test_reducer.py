"""GradientReducer: bucketed all-reduce started from backward hooks, on a real gloo group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from distributed import Client

import dask_train as dt
from dask_train.engines._reducer import META, GradientReducer
from dask_train.models import FlatModel


def _net() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5 + rank, 8, generator=g), torch.randint(0, 4, (5 + rank,), generator=g)


def _bucketed(bucket_bytes: int, idle_rank: int | None) -> dict[str, Any]:
    """Two steps with the reducer; ``idle_rank`` does no backward in step 1 (out of data)."""
    rank = dist.get_rank()
    model = FlatModel(_net())
    reducer = GradientReducer(model, bucket_bytes=bucket_bytes)
    out: dict[str, Any] = {"n_buckets": reducer.n_buckets, "sums": [], "started_in_backward": []}
    for step in range(2):
        reducer.reset()
        if step == 1 and rank == idle_rank:
            reducer.meta[0] = 0
            started = 0
        else:
            x, y = _batch(rank, step)
            reducer.meta[0] = len(x)
            loss = torch.nn.functional.cross_entropy(model.module(x), y)
            reducer.backward(loss * len(x), reduce=True)
            started = len(reducer._works)  # buckets whose all-reduce began during backward
        reducer.start_rest()
        reducer.wait()
        out["started_in_backward"].append(started)
        out["sums"].append(reducer.buf.clone())
    return out


def _reference(idle_rank: int | None) -> list[torch.Tensor]:
    """The same two steps with one all-reduce of a hand-gathered flat gradient after backward."""
    rank = dist.get_rank()
    model = FlatModel(_net())
    sums = []
    for step in range(2):
        buf = torch.zeros(META + model.n_params)
        if not (step == 1 and rank == idle_rank):
            x, y = _batch(rank, step)
            model.gradient(x, y, torch.nn.functional.cross_entropy, out=buf[META:])
            buf[META:] *= len(x)
            buf[0] = len(x)
        dist.all_reduce(buf)
        sums.append(buf)
    return sums


def test_buckets_start_during_backward_and_sum_like_one_all_reduce(client: Client) -> None:
    group = dt.start_torch(client, workers=2, backend="gloo", timeout=60)
    try:
        # 4 bytes per bucket: every parameter is its own bucket (6 collectives per step).
        bucketed = client.gather(group.run(_bucketed, 4, 1))
        reference = client.gather(group.run(_reference, 1))
    finally:
        group.close()
    for rank in range(2):
        got = bucketed[rank]
        assert got["n_buckets"] == 6
        # Every bucket began before backward returned, except on the rank that had no backward.
        assert got["started_in_backward"] == [6, 6 if rank == 0 else 0]
        for step in range(2):
            torch.testing.assert_close(got["sums"][step], reference[rank][step], rtol=1e-5,
                                       atol=1e-5)
    # The all-reduce leaves every rank with the same sums, the idle rank's zeros included.
    assert torch.equal(bucketed[0]["sums"][1], bucketed[1]["sums"][1])
    assert bucketed[0]["sums"][1][0] == 5  # only rank 0's 5 samples in step 1


def _inner_steps_start_nothing() -> list[int]:
    model = FlatModel(_net())
    reducer = GradientReducer(model, bucket_bytes=4)
    started = []
    x, y = _batch(dist.get_rank(), 0)
    for reduce in (False, False, True):
        loss = torch.nn.functional.cross_entropy(model.module(x), y)
        reducer.backward(loss, reduce=reduce)
        started.append(len(reducer._works))
    reducer.wait()
    return started


def test_accumulation_steps_start_no_collective(client: Client) -> None:
    group = dt.start_torch(client, workers=2, backend="gloo", timeout=60)
    try:
        started = client.gather(group.run(_inner_steps_start_nothing))
    finally:
        group.close()
    assert started == [[0, 0, 6], [0, 0, 6]]


def test_gradients_are_views_into_the_reduced_buffer() -> None:
    if not dist.is_initialized():
        # A one-rank group in this process is enough for the layout; gloo on a free port.
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = FlatModel(_net())
        reducer = GradientReducer(model, bucket_bytes=1 << 20)
        x, y = _batch(0, 0)
        reducer.backward(torch.nn.functional.cross_entropy(model.module(x), y), reduce=True)
        reducer.start_rest()
        reducer.wait()
        storage = reducer.buf.untyped_storage().data_ptr()
        assert all(p.grad is not None and p.grad.untyped_storage().data_ptr() == storage
                   for p in model.params)
        got = reducer.grad.clone()
        expected = torch.zeros(model.n_params)
        model.gradient(x, y, torch.nn.functional.cross_entropy, out=expected)
        assert reducer.n_buckets == 1
        torch.testing.assert_close(got, expected)
    finally:
        dist.destroy_process_group()
