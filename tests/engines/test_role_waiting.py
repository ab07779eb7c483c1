"""Waiting on role tasks leaves nothing for asyncio to complain about: a gather given up (its
wait cancelled, a hand-over's write given up) whose futures are cancelled next logged "Task
exception was never retrieved ... FutureCancelledError" as an ERROR in the client's process (a
dt.run whose every worker ended its lifetime at once, once in a suite run)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest
from distributed import Client

from dask_train.data._cluster import live_workers
from dask_train.engines.roles.waiting import gather_watching
from dask_train.runtime._quiet_logs import quiet_client


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


async def _give_up(client: Client, address: str) -> None:
    futures = [client.submit(_sleep, 2.0, workers=[address], pure=False)]
    waiting = asyncio.ensure_future(gather_watching(
        client, futures, what="a test's wait", holders={address: "holder"}, release=False,
        timeout=60.0))
    await asyncio.sleep(0.5)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await client.cancel(futures, asynchronous=True)
    await asyncio.sleep(1.0)  # the cancellation comes back; the task (2 s) has ended
    del futures, waiting
    gc.collect()  # an unread task exception is logged as its task is collected
    await asyncio.sleep(0.1)


def test_a_cancelled_gather_of_cancelled_futures_logs_no_error(
        client: Client, caplog: pytest.LogCaptureFixture) -> None:
    # As in every job's process: distributed's own orphaned waits (AllExit) are filtered.
    quiet_client()
    address = sorted(live_workers(client))[0]
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        client.sync(_give_up, client, address)
        gc.collect()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
