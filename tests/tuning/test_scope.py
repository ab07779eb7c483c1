"""A job's worker scope: role placement, liveness and the spreading of blocks see only its workers,
from any thread and inside the client's event loop."""

from __future__ import annotations

import threading
import time
from typing import Any

import dask.array as da
import numpy as np
from distributed import Client

from dask_train.data import persist_blocks
from dask_train.data._cluster import live_workers
from dask_train.policy._scope import current_scope, use_workers
from dask_train.runtime import worker_threads
from dask_train.runtime._calls import alive_workers


def test_a_scope_restricts_what_the_job_sees_in_every_thread(client: Client) -> None:
    first, second = sorted(live_workers(client))
    seen: dict[str, object] = {}

    def job() -> None:
        with use_workers([second]):
            seen["threads"] = worker_threads(client)
            # Through Client.sync: the coroutine runs on the client's event loop thread.
            seen["alive"] = client.sync(alive_workers, client)
        seen["after"] = current_scope()

    thread = threading.Thread(target=job)
    thread.start()
    thread.join(timeout=30)
    assert seen["threads"] == {second: 1} and seen["alive"] == {second: 1}
    assert seen["after"] is None
    assert set(client.sync(alive_workers, client)) == {first, second}  # this thread: no scope


def _statuses(dask_scheduler: Any) -> dict[str, str]:
    return {a: ws.status.name for a, ws in dask_scheduler.workers.items()}


def test_blocks_are_persisted_on_the_scope_and_reused_from_its_cache(client: Client) -> None:
    # The blocks are placed on the scope strictly (work stealing moved loosely placed ones to
    # the idle worker, fc51): they wait for a target that does not run tasks yet (paused by an
    # earlier test's memory on this shared cluster, or restarted by its nanny). Both run first.
    deadline = time.monotonic() + 30
    while set(client.run_on_scheduler(_statuses).values()) != {"running"} and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    workers = sorted(live_workers(client))
    X = da.from_array(np.arange(4_000, dtype=np.float32).reshape(1_000, 4), chunks=(100, 4))
    y = da.from_array(np.arange(1_000) % 3, chunks=100)
    cache: dict = {}
    for target in workers:
        with use_workers([target], cache=cache):
            blocks = client.sync(persist_blocks, client, X, y)
            again = client.sync(persist_blocks, client, X, y)
        assert again is blocks  # the same gang: the cached blocks
        holders = client.who_has(blocks.futures)
        assert all(set(h) == {target} for h in holders.values()), \
            (holders, client.run_on_scheduler(_statuses))
    assert len(cache) == 2
    cache.clear()
