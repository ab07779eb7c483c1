"""Persisting data that does not fit: a worker paused at its memory limit would make the persist
wait for ever; it ends in DataDoesNotFit naming the worker and the fix, and the cluster is left
as it was (the blocks released, the workers running again). A real cluster with a real limit."""

from __future__ import annotations

import time
from collections.abc import Iterator

import dask
import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster

import dask_train as dt
from dask_train.data._cluster import live_workers

MEMORY_LIMIT = 600 * 2**20


@pytest.fixture(scope="module")
def tight() -> Iterator[Client]:
    # No spilling (the other case), a pause at 70% (420 MiB) and no termination: a
    # persist of more than the free memory stops with the worker paused, as on a cluster
    # whose scratch disk is full or off.
    memory = {"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
              "distributed.worker.memory.pause": 0.7, "distributed.worker.memory.terminate": False}
    with dask.config.set(memory), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0",
                         memory_limit=MEMORY_LIMIT) as cluster, Client(cluster) as client:
        yield client


def _statuses(client: Client) -> set[str]:
    workers = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
    return {w["status"] for w in workers.values()}


def test_a_persist_that_pauses_its_worker_fails_naming_it_and_frees_the_memory(
        tight: Client) -> None:
    # 600 MB of features: more than the worker's 600 MiB limit holds beside its own ~300 MiB.
    X = da.random.RandomState(0).standard_normal((75_000, 2_000), chunks=(2_500, 2_000))
    X = X.astype(np.float32)
    y = da.random.RandomState(1).randint(0, 3, size=75_000, chunks=2_500)
    trainer = dt.Trainer(torch.nn.Linear(2_000, 3), ps=1, workers=1, epochs=1, progress=False,
                         client=tight)
    [address] = live_workers(tight)
    started = time.monotonic()
    with dask.config.set({"dask-train.persist-stall": 3}), \
            pytest.raises(dt.DataDoesNotFit) as info:
        trainer.fit(X, y, data="persist")
    message = str(info.value)
    assert address in message and "600 MiB" not in message  # limits in GiB: 0.6 GiB
    assert "0.6 GiB" in message and "data='stream'" in message and "paused" in message
    assert time.monotonic() - started < 60
    # The blocks were released: the worker's memory falls and it runs again.
    deadline = time.monotonic() + 30
    while _statuses(tight) != {"running"} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _statuses(tight) == {"running"}
