"""Waiting for futures on the client's event loop, and for persisted data without hanging on
paused workers.

A Dask worker above its memory ``pause`` fraction runs no task until its memory falls, and
persisted blocks never fall: a persist of data that does not fit waits for ever, with nothing on
the client saying why. :func:`wait_persisted` waits as ``distributed.wait`` would, and ends the
wait with :class:`~dask_train.errors.DataDoesNotFit` once no block has finished for ``stall_s``
seconds while a worker is paused.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import dask
from distributed import Client, Future

from dask_train.errors import DataDoesNotFit

#: How often the wait looks at the cluster.
CHECK_S = 2.0
#: Seconds without a finished block, with a worker paused, before the wait gives up (Dask
#: config ``dask-train.persist-stall``).
STALL_S = 30.0


async def paused_workers(client: Client) -> dict[str, dict[str, Any]]:
    """The workers the scheduler says are paused (address -> its record), asked now."""
    info = await client.scheduler.identity(n_workers=-1)
    return {a: w for a, w in info.get("workers", {}).items() if w.get("status") == "paused"}


async def wait_persisted(client: Client, futures: list[Future], *, what: str,
                         stall_s: float | None = None, check_s: float = CHECK_S) -> None:
    """Wait until every future is done; raise :class:`DataDoesNotFit` when none finished for
    ``stall_s`` seconds while a worker is paused (the futures are released first).

    ``what`` names the data in the message (``"X and y"``).
    """
    if stall_s is None:
        stall_s = float(dask.config.get("dask-train.persist-stall", STALL_S))
    check_s = min(check_s, stall_s)
    done_before, progress_at = -1, time.monotonic()
    while True:
        try:
            await wait_futures(futures, timeout=check_s)
            return
        except TimeoutError:
            pass
        done = sum(f.status != "pending" for f in futures)
        if done != done_before:
            done_before, progress_at = done, time.monotonic()
            continue
        if time.monotonic() - progress_at < stall_s:
            continue
        paused = await paused_workers(client)
        if paused:
            await client.cancel(futures, asynchronous=True)
            raise DataDoesNotFit(_message(what, paused, done, len(futures), stall_s))


async def wait_futures(futures: list[Future], timeout: float | None = None) -> None:
    """Wait, on the running event loop, until every future is finished, erred or cancelled.

    Not ``distributed.wait``: it waits through the *current default* client, which in a thread
    holding another client (``with Client(...)``, a search trial) is not the futures' own, and
    the wait never ends. A future's own done-callback reports to this loop instead. Raises
    ``TimeoutError`` after ``timeout`` seconds.
    """
    pending = [f for f in futures if f.status == "pending"]
    if not pending:
        return
    loop = asyncio.get_running_loop()
    left, done = [len(pending)], asyncio.Event()

    def one_done() -> None:
        left[0] -= 1
        if left[0] <= 0:
            done.set()

    for future in pending:
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(one_done))
    try:
        await asyncio.wait_for(done.wait(), timeout)
    except asyncio.TimeoutError:  # a distinct class before Python 3.11
        raise TimeoutError(f"futures not done within {timeout} s") from None


def _message(what: str, paused: dict[str, dict[str, Any]], done: int, total: int,
             stall_s: float) -> str:
    names = ", ".join(
        f"{a} (memory limit {_gib(w.get('memory_limit'))})" for a, w in sorted(paused.items()))
    return (
        f"persisting {what} stalled: {done} of {total} blocks were computed, and none for "
        f"{stall_s:g} s while the workers {names} are paused at their memory limit (Dask's "
        "'distributed.worker.memory.pause' fraction). The data does not fit in the workers' "
        "memory: pass data='stream' to fit (blocks are read from their source each epoch, a "
        "few at a time), or add workers or memory")


def _gib(n: Any) -> str:
    return f"{n / 2**30:.1f} GiB" if isinstance(n, (int, float)) and n else "none"
