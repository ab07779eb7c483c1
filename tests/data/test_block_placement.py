"""Persisted blocks land on the workers chosen for them, busy or not, and a chosen worker that
leaves during the persist does not leave its blocks waiting.

A real scheduler (work stealing on, Dask's default) and real workers in this process. A loosely
placed block (``allow_other_workers=True``) is handed by work stealing to an idle worker while
its target is busy: a search trial's blocks then landed outside its workers.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import dask.array as da
import numpy as np
from distributed import Client, Scheduler, Worker

from dask_train.data._blocks import persist_pairs
from dask_train.policy._placement import balance_blocks
from dask_train.policy._scope import use_workers

BLOCKS = 12


#: Lets ``_hold`` end; the workers run in this process, so they see it (a task's arguments
#: would be pickled).
_RELEASE = threading.Event()


def _hold() -> None:
    """A task that keeps its worker's one thread until the test lets it go."""
    _RELEASE.wait(30)


async def _hold_a(client: Client, a: Worker) -> None:
    _RELEASE.clear()
    client.submit(_hold, workers=[a.address], pure=False)
    while not a.state.executing_count:
        await asyncio.sleep(0.01)


@asynccontextmanager
async def _cluster() -> AsyncIterator[tuple[Scheduler, Worker, Worker, Client]]:
    async with Scheduler(dashboard_address=":0", port=0) as s, \
            Worker(s.address, nthreads=1) as a, Worker(s.address, nthreads=1) as b, \
            Client(s.address, asynchronous=True) as client:
        yield s, a, b, client


def _data() -> tuple[da.Array, da.Array]:
    # One reader task per block (a generator per block), so each block is one placed task.
    X = da.random.default_rng(0).random((BLOCKS * 50, 4), chunks=(50, 4))
    return X, (X[:, 0] > 0.5).astype("int64")


async def _persisted_while_a_is_busy(client: Client) -> tuple[list[Any], dict[Any, Any]]:
    """``_data()`` persisted while worker a's one thread is held, long enough for work stealing
    (every 100 ms) to move what it may to the idle b; the blocks and who holds them."""
    X, y = _data()
    persist = asyncio.ensure_future(persist_pairs(client, X, y))
    await asyncio.sleep(1.5)
    _RELEASE.set()
    futures = await persist
    return futures, await client.scheduler.who_has(keys=[f.key for f in futures])


async def _busy_target_keeps_its_blocks() -> None:
    async with _cluster() as (s, a, b, client):
        await _hold_a(client, a)
        futures, who_has = await _persisted_while_a_is_busy(client)
        targets = balance_blocks([50] * BLOCKS, [""] * BLOCKS, {a.address: 1, b.address: 1})
        assert [sorted(who_has[f.key]) for f in futures] == [[t] for t in targets]
        assert targets.count(a.address) == BLOCKS // 2


def test_blocks_wait_for_their_busy_worker_rather_than_land_elsewhere() -> None:
    asyncio.run(_busy_target_keeps_its_blocks())


async def _scope_of_one_worker_gets_every_block() -> None:
    async with _cluster() as (s, a, b, client):
        await _hold_a(client, a)
        with use_workers([a.address]):
            futures, who_has = await _persisted_while_a_is_busy(client)
        assert all(set(who_has[f.key]) == {a.address} for f in futures), who_has
        assert not b.data  # nothing was read outside the scope


def test_a_scope_of_one_busy_worker_gets_every_block() -> None:
    asyncio.run(_scope_of_one_worker_gets_every_block())


async def _target_leaving_during_persist() -> None:
    async with _cluster() as (s, a, b, client):
        await _hold_a(client, a)
        X, y = _data()
        persist = asyncio.ensure_future(persist_pairs(client, X, y))
        while sum(str(ts.key).startswith("dt-block-")
                  for ts in s.workers[a.address].processing) < BLOCKS // 2:
            await asyncio.sleep(0.01)
        # a leaves with its blocks unread; strictly placed on a, they must go to b.
        await a.close(executor_wait=False)
        _RELEASE.set()
        futures = await asyncio.wait_for(persist, 30)
        who_has = await client.scheduler.who_has(keys=[f.key for f in futures])
        assert all(set(who_has[f.key]) == {b.address} for f in futures), who_has
        pairs = await client.gather(futures)
        np.testing.assert_array_equal(np.concatenate([p[0] for p in pairs]), X.compute(scheduler="sync"))


def test_blocks_of_a_worker_that_leaves_during_the_persist_go_to_the_others() -> None:
    asyncio.run(_target_leaving_during_persist())


async def _block_lost_after_the_persist() -> None:
    async with _cluster() as (s, a, b, client):
        X, y = _data()
        futures = await persist_pairs(client, X, y)
        assert any(a.address in ws for ws in (await client.scheduler.who_has(
            keys=[f.key for f in futures])).values())
        await a.close()  # a's blocks are lost: Dask computes them again, on b
        pairs = await asyncio.wait_for(client.gather(futures), 30)
        np.testing.assert_array_equal(np.concatenate([p[0] for p in pairs]),
                                      X.compute(scheduler="sync"))
        who_has = await client.scheduler.who_has(keys=[f.key for f in futures])
        assert all(set(who_has[f.key]) == {b.address} for f in futures), who_has


def test_a_block_lost_after_the_persist_is_computed_again_on_another_worker() -> None:
    # Placed strictly while persisted, loose once in memory: strict, it would wait for ever.
    asyncio.run(_block_lost_after_the_persist())
