"""Calls from the client to the workers that must never wait on a dead one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from distributed import Client

from dask_train.policy._scope import in_scope


def live_workers(client: Client) -> dict[str, Any]:
    """Every live Dask worker (address -> the scheduler's record of it), asked of the scheduler
    now, from a thread other than the client's event loop.

    Not ``client.scheduler_info(n_workers=-1)["workers"]``: that reads the client's cached
    identity after refreshing it, and the client's own periodic refresh (without workers) can
    overwrite it in between: 3 of 1,000 calls saw no worker at all (measured with the refresh
    every 5 ms), and a search once took a running trial's live worker for lost.
    """
    info = client.sync(client.scheduler.identity, n_workers=-1)
    return dict(info.get("workers", {}))


async def alive_workers(client: Client) -> dict[str, int]:
    """Live Dask workers and their thread counts, as the scheduler sees them now (those of the
    current job's scope, see :func:`~dask_train.policy._scope.use_workers`)."""
    info = (await client.scheduler.identity()).get("workers", {})
    return in_scope({addr: int(w.get("nthreads", 1)) for addr, w in info.items()})


async def run_on_live(client: Client, fn: Any, *args: Any, workers: Sequence[str],
                      **kwargs: Any) -> Any:
    """``client.run`` on those of ``workers`` still alive.

    A call to a dead worker's address waits for the 30 s connect timeout even with
    ``on_error="ignore"``: never send one.
    """
    alive = await alive_workers(client)
    targets = [w for w in workers if w in alive]
    if not targets:
        return {}
    return await client.run(fn, *args, workers=targets, asynchronous=True, on_error="ignore",
                            **kwargs)
