"""GradientReducer: bucketed all-reduce started from backward hooks, on a real gloo group."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from distributed import Client

import dask_train as dt
from dask_train.engines.collectives.reducer import GradientReducer, meta_size
from dask_train.models import FlatModel


def _net() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5 + rank, 8, generator=g), torch.randint(0, 4, (5 + rank,), generator=g)


@contextmanager
def _collectives() -> Iterator[list[str]]:
    """Record every collective started through torch.distributed while the block runs.

    The test's own hook on the public collective functions, so what the reducer starts, and when,
    is observed from outside it; the reducer calls them as ``dist.<name>`` at call time.
    """
    started: list[str] = []
    saved = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def wrap(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            started.append(name)
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield started
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _bucketed(bucket_bytes: int, idle_rank: int | None) -> dict[str, Any]:
    """Two steps with the reducer; ``idle_rank`` does no backward in step 1 (out of data)."""
    rank = dist.get_rank()
    model = FlatModel(_net())
    reducer = GradientReducer(model, bucket_bytes=bucket_bytes)
    out: dict[str, Any] = {"n_buckets": reducer.n_buckets, "sums": [], "started_in_backward": [],
                           "before_first_layer": [], "per_step": []}
    # The test's own hooks, registered after the reducer's, so each runs once the reducer has seen
    # that gradient: how many collectives had started when the first layer's gradients (the last
    # that backward computes) began to arrive shows whether communication overlapped backward.
    first_layer = {id(p) for p in model.module[0].parameters()}
    seen: list[int] = []
    for p in model.module.parameters():
        p.register_post_accumulate_grad_hook(
            lambda p: seen.append(len(started)) if id(p) in first_layer else None)
    for step in range(2):
        reducer.reset()
        seen.clear()
        with _collectives() as started:
            if step == 1 and rank == idle_rank:
                reducer.meta[0] = 0
                in_backward = 0  # no backward at all
            else:
                x, y = _batch(rank, step)
                reducer.meta[0] = len(x)
                loss = torch.nn.functional.cross_entropy(model.module(x), y)
                reducer.backward(loss * len(x), reduce=True)
                in_backward = len(started)  # collectives begun before backward returned
            reducer.start_rest()
            reducer.wait()
        out["started_in_backward"].append(in_backward)
        out["before_first_layer"].append(seen[0] if seen else None)
        out["per_step"].append(len(started))
        out["sums"].append(reducer.buf.clone())
    return out


def _reference(idle_rank: int | None) -> list[torch.Tensor]:
    """The same two steps with one all-reduce of a hand-gathered flat gradient after backward."""
    rank = dist.get_rank()
    model = FlatModel(_net())
    sums = []
    head = meta_size(dist.get_world_size())  # the votes, then each rank's position (zeros here)
    for step in range(2):
        buf = torch.zeros(head + model.n_params)
        if not (step == 1 and rank == idle_rank):
            x, y = _batch(rank, step)
            model.gradient(x, y, torch.nn.functional.cross_entropy, out=buf[head:])
            buf[head:] *= len(x)
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
        # Backward still had the first layer to do when the later layers' buckets (4 of the 6:
        # the last two layers' weights and biases) were already on the wire.
        # (5 when the first layer's bias comes in before its weight and starts its own bucket.)
        assert all(n is not None and n >= 4 for n in got["before_first_layer"][: 2 if rank == 0 else 1])
        assert rank == 0 or got["before_first_layer"][1] is None
        assert got["per_step"] == [6, 6]  # the idle rank starts the same collectives over zeros
        for step in range(2):
            torch.testing.assert_close(got["sums"][step], reference[rank][step], rtol=1e-5,
                                       atol=1e-5)
    # The all-reduce leaves every rank with the same sums, the idle rank's zeros included.
    assert torch.equal(bucketed[0]["sums"][1], bucketed[1]["sums"][1])
    assert bucketed[0]["sums"][1][0] == 5  # only rank 0's 5 samples in step 1


def _inner_steps_start_nothing() -> list[int]:
    model = FlatModel(_net())
    reducer = GradientReducer(model, bucket_bytes=4)
    counts = []
    x, y = _batch(dist.get_rank(), 0)
    with _collectives() as started:
        for reduce in (False, False, True):
            loss = torch.nn.functional.cross_entropy(model.module(x), y)
            reducer.backward(loss, reduce=reduce)
            counts.append(len(started))  # collectives begun so far, all of them during backward
        reducer.wait()
    return counts


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


def _positions_step(big: bool) -> tuple[Any, Any]:
    model = FlatModel(_net())
    reducer = GradientReducer(model, bucket_bytes=1 << 20)
    rank = dist.get_rank()
    # Rank 0 is 640 rows into block 7 of epoch 1; rank 1 is between blocks.
    position = ([0, 3, 1 << 24] if big else [1, 7, 640]) if rank == 0 else None
    reducer.set_meta(5.0, 0.0, 1.0 if rank == 1 else 0.0, position)
    reducer.start_rest()
    reducer.wait()
    return reducer.meta_values(), reducer.positions


def test_every_rank_learns_every_ranks_position_with_the_step(client: Client) -> None:
    # What a survivor of a lost rank goes on from: each rank's [epoch, block, rows] after the
    # step, summed from its own slot; a rank between blocks sends none.
    group = dt.start_torch(client, workers=2, backend="gloo", timeout=60)
    try:
        got = group.gather(group.run(_positions_step, False))
        big = group.gather(group.run(_positions_step, True))
    finally:
        group.close()
    for values, positions in got:
        assert values == (10.0, 0.0, 1.0, 0.0)  # samples, stop and pause votes, non-finite: summed
        assert positions == [[1, 7, 640], None]
    # Past what float32 holds exactly, no position is kept (the job then restarts from its
    # stored checkpoint instead).
    assert [positions for _, positions in big] == [None, None]
