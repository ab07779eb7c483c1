"""Calls from the client to the workers that must never wait on a dead one."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from distributed import Client

# Asked of the scheduler by the data layer too: defined there, one function for both.
from dask_train.data._cluster import live_workers as live_workers
from dask_train.policy._scope import in_scope


async def alive_workers(client: Client) -> dict[str, int]:
    """Live Dask workers and their thread counts, as the scheduler sees them now (those of the
    current job's scope, see :func:`~dask_train.policy._scope.use_workers`)."""
    info = (await client.scheduler.identity()).get("workers", {})
    return in_scope({addr: int(w.get("nthreads", 1)) for addr, w in info.items()})


#: How often a call to the workers looks whether one of them died meanwhile.
CHECK_S = 0.5


async def run_on_live(client: Client, fn: Any, *args: Any, workers: Sequence[str],
                      **kwargs: Any) -> Any:
    """``client.run`` on those of ``workers`` still alive.

    A call to a dead worker's address waits for the 30 s connect timeout even with
    ``on_error="ignore"``: never send one. A worker killed just as the call goes out is still
    on the scheduler's list; so while the call runs, the list is asked again every
    :data:`CHECK_S` seconds, and once a target has left, the call is sent again to the live
    ones (every function sent here may run twice: they set flags or read).
    """
    while True:
        alive = await alive_workers(client)
        targets = [w for w in workers if w in alive]
        if not targets:
            return {}
        call = asyncio.ensure_future(client.run(fn, *args, workers=targets, asynchronous=True,
                                                on_error="ignore", **kwargs))
        while True:
            done, _ = await asyncio.wait({call}, timeout=CHECK_S)
            if done:
                return call.result()
            alive = await alive_workers(client)
            if any(w not in alive for w in targets):
                call.cancel()
                break
