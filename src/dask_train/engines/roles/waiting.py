"""Waiting on the parameter holders' tasks without waiting on a dead holder."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from distributed import Client, Future

from dask_train.errors import TrainingTimeout, WorkerLost
from dask_train.runtime._calls import alive_workers


async def raise_if_gone(client: Client, holders: Mapping[str, str], release: list[Future],
                        what: str) -> None:
    """Raise WorkerLost naming the first of ``holders`` (address -> role) that left the
    cluster, after releasing the futures ``release``."""
    alive = await alive_workers(client)
    gone = [(addr, role) for addr, role in holders.items() if addr not in alive]
    if gone:
        for fut in release:
            fut.release()
        addr, role = gone[0]
        raise WorkerLost(f"{what}: {role}'s worker {addr} left the cluster",
                         worker=addr, role=role) from None


async def gather_watching(client: Client, futures: list[Future], *, what: str,
                          holders: Mapping[str, str], release: bool,
                          timeout: float) -> list[Any]:
    """The results of finished role tasks, giving up with WorkerLost when a holder dies.

    A holder that dies after its task finished but before its result came back makes Dask
    run the task again, pinned to the dead worker: a plain gather would wait for ever (seen
    as a hung checkpoint write when a host was killed). ``release``: release the futures then.
    """
    gather = asyncio.ensure_future(client.gather(futures, asynchronous=True))
    deadline = time.monotonic() + timeout
    while True:
        done, _ = await asyncio.wait({gather}, timeout=1.0)
        if done:
            return list(gather.result())
        try:
            await raise_if_gone(client, holders, futures if release else [], what)
        except WorkerLost:
            gather.cancel()
            raise
        if time.monotonic() >= deadline:
            gather.cancel()
            raise TrainingTimeout(f"{what}: the results did not come back within {timeout:g} s")
