"""Blocks whose every preferred worker left are sent to the workers that run now.

A real scheduler and real workers in this process: the block's only worker closes while the
other one is paused, so the block waits in ``no-worker``; Dask does not give it to that worker
when it runs again (its restriction names the gone worker), and ``schedule_stranded`` does,
once the worker runs, never before.
"""

from __future__ import annotations

import asyncio

from distributed import Client, Scheduler, Worker

from dask_train.data._stall import schedule_stranded


def _double(x: int) -> int:
    return 2 * x


async def _stranded_block_is_sent_once_a_worker_runs() -> None:
    async with Scheduler(dashboard_address=":0", port=0) as s, \
            Worker(s.address, nthreads=1) as gone, Worker(s.address, nthreads=1) as late, \
            Client(s.address, asynchronous=True) as client:
        block = client.submit(_double, 21, key="dt-block-test", workers=[gone.address],
                              allow_other_workers=True, pure=False)
        assert await block == 42
        # The worker that joins has registered but does not run yet (as one just started).
        s.handle_worker_status_change("paused", late.address, stimulus_id="test-paused")
        await gone.close()
        while s.tasks["dt-block-test"].state != "no-worker":
            await asyncio.sleep(0.01)
        assert schedule_stranded(dask_scheduler=s) == (0, 1)  # nothing runs: it waits
        s.handle_worker_status_change("running", late.address, stimulus_id="test-running")
        await asyncio.sleep(0.2)
        # Dask itself leaves it there: its restriction names the worker that left.
        assert s.tasks["dt-block-test"].state == "no-worker"
        assert schedule_stranded(dask_scheduler=s) == (1, 0)
        assert await asyncio.wait_for(block, 10) == 42
        assert block.key in late.data


def test_a_stranded_block_is_computed_again_once_a_worker_runs() -> None:
    asyncio.run(_stranded_block_is_sent_once_a_worker_runs())
