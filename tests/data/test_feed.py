"""Feeding blocks to trainers: the worker's direct feed handler and the controller's use of it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from distributed import Client, get_task_stream

import dask_train as dt
from dask_train.data._cluster import live_workers
from dask_train.runtime import worker_state
from dask_train.runtime._roles import ensure_plugin


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))


def test_the_feed_handler_queues_held_blocks_and_declines_the_rest(client: Client) -> None:
    ensure_plugin(client)
    address = sorted(live_workers(client))[0]
    block = client.scatter([(np.ones((3, 2), np.float32), np.zeros(3))], workers=[address],
                           direct=True)[0]
    client.run(lambda dask_worker: worker_state(dask_worker).job("feed-test").feed(0).qsize(),
               workers=[address])  # creates the job's state there, as a trainer would
    args = dict(trainer=0, seq=0, epoch=0, block=7, seed=0, shuffle=False)
    try:
        feed = client.rpc(address).dask_train_feed
        assert client.sync(feed, job="feed-test", key=block.key, **args) == 3
        # Not held here, or a job that ended on this worker: declined, the caller uses a task.
        assert client.sync(feed, job="feed-test", key="no-such-key", **args) == -1
        client.run(lambda dask_worker: worker_state(dask_worker).drop("ended-job"), workers=[address])
        assert client.sync(feed, job="ended-job", key=block.key, **args) == -1
        assert client.run(lambda dask_worker: "ended-job" in worker_state(dask_worker).jobs,
                          workers=[address]) == {address: False}

        def queued(dask_worker: Any) -> list[tuple[int, int]]:
            q = worker_state(dask_worker).job("feed-test").feed(0)
            items = [q.get_nowait() for _ in range(q.qsize())]
            return [(item.block, item.rows) for item in items]

        assert client.run(queued, workers=[address])[address] == [(7, 3)]
    finally:
        client.run(lambda dask_worker: worker_state(dask_worker).drop("feed-test"),
                   workers=[address])


def test_local_blocks_reach_the_trainers_without_a_task_each(client: Client) -> None:
    X, y = dt.datasets.digits(8_000, seed=0, chunks=500)  # 16 blocks
    X, y = client.persist([X, y])
    # Dask's public task stream records every task that ran; feed tasks are the keys named
    # "dt-feed-..." (as the dashboard shows them).
    with get_task_stream(client) as stream:
        result = dt.Trainer(mlp(), strategy="sync", workers=2, scorer=0, batch_size=250, epochs=2,
                            progress=False, client=client).fit(X, y)
    tasks = len({str(r["key"]) for r in stream.data if str(r["key"]).startswith("dt-feed")})
    assert result.epochs_completed == 2 and result.samples == 16_000
    assert len(result.ledger) == 32
    moved = int((~result.ledger["local"]).sum())  # sync evens out the ranks' blocks
    assert moved <= 4
    # A task per moved block (Dask brings it over). Dask's active memory manager may then
    # drop the block's first copy, so the next epoch's local grant of it also needs a task:
    # at most one more per moved block over the 2 epochs. Every other grant is one RPC.
    assert moved <= tasks <= 2 * moved
