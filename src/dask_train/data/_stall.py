"""Waiting for futures on the client's event loop, and for persisted data without hanging on
paused workers or on workers that left.

A Dask worker above its memory ``pause`` fraction runs no task until its memory falls, and
persisted blocks never fall: a persist of data that does not fit waits for ever, with nothing on
the client saying why. :func:`wait_persisted` waits as ``distributed.wait`` would, and ends the
wait with :class:`~dask_train.errors.DataDoesNotFit` once no block has finished for ``stall_s``
seconds while a worker is paused.

Blocks are placed on their workers strictly (``allow_other_workers=False``): with a loose
restriction Dask's work stealing hands a block to any idle worker while its target is busy, so
a search trial's blocks landed outside its workers (ten of ten in a run with the target busy).
A block whose every worker left during the persist would then wait in ``no-worker`` for ever:
:func:`schedule_stranded`, run by these waits, sends it to the workers running now. Once in
memory, the blocks' restrictions are made loose (:func:`relax_placement`): a block lost later
is computed again wherever Dask likes.
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
        # A block placed on a worker that left waits for it: it goes to the workers there are.
        await client.run_on_scheduler(schedule_stranded, asynchronous=True)
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


def relax_placement(keys: list[Any], dask_scheduler: Any = None) -> int:
    """Run on the scheduler once the blocks ``keys`` are in memory where they were placed: their
    restriction becomes loose, so that Dask computes a block lost later (its worker killed
    during a job) again on any worker, not only on the one that left; one lost meanwhile goes
    to the workers there are now. How many were loosened."""
    import time

    loosened, stranded = 0, []
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is None or not (ts.worker_restrictions or ts.host_restrictions):
            continue
        ts.loose_restrictions = True
        loosened += 1
        if ts.state == "no-worker":
            stranded.append(ts.key)
    if stranded and dask_scheduler.running:
        dask_scheduler.transitions({key: "processing" for key in stranded},
                                   stimulus_id=f"dask-train-placed-{time.time()}")
    return loosened


def drop_fetches_from(addresses: list[str], dask_worker: Any = None) -> int:
    """Run on the live workers (``client.run``, on each one's event loop) once ``addresses``
    left the cluster: close this worker's connections to them and give up its attempts to
    connect, as Dask does itself when the scheduler says a worker left. How many of the
    addresses this worker was connected or connecting to.

    Why again: a worker told in one message batch to fetch a block from a peer and that the
    peer left starts the fetch after it has dropped that peer, and its connect to the dead
    address is retried for Dask's connect timeout (30 s by default). The block, which the
    scheduler then asked it to compute, waits for that fetch ("resumed"), and so does every
    feed of a trainer that needs it (seen: an async trainer fed nothing for 30 s after the
    worker holding its next block was killed, 2 runs in about 40; the worker's story showed
    the fetch requested after the worker's removal). Given up, the fetch fails at once and
    the worker computes the block.
    """
    pool = dask_worker.rpc
    connecting = getattr(pool, "_connecting", {})  # not public: only counted
    held = sum(1 for a in addresses
               if a in pool.available or a in pool.occupied or connecting.get(a))
    for address in addresses:
        pool.remove(address)
    return held


#: Key prefixes of the tasks that place data blocks on chosen workers (``data._blocks``): the
#: only strictly placed tasks :func:`schedule_stranded` may send elsewhere. A role's task is
#: strictly placed too, and must never run elsewhere: the controller replaces a lost role.
PLACED_PREFIXES = ("dt-block-", "dt-spread-")


def schedule_stranded(dask_scheduler: Any = None) -> tuple[int, int]:
    """Run on the scheduler: send dask-train's data blocks whose every chosen worker left to the
    workers running now; how many were sent, and how many still wait (no worker runs yet).

    Why: a block placed strictly (:data:`PLACED_PREFIXES`) waits in ``no-worker`` once its
    worker left, when Dask computes it again (its worker was lost) or before it ever ran; and
    when every worker a loosely placed task prefers has left, distributed gives it to a worker
    that joins only when that worker is one of its restrictions
    (``bulk_schedule_unrunnable_after_adding_worker`` reads ``valid_workers``, which does not
    loosen them; dask/distributed#7346): after the whole cluster was replaced (every Slurm job
    reaching its lifetime at once) the next generation's blocks never came. A stranded task's
    restriction is made loose, so Dask places it on a worker that runs. A worker that has
    registered but not yet said it runs takes no task: those wait for the next call.
    """
    import time

    def placed(ts: Any) -> bool:
        key = ts.key[0] if isinstance(ts.key, tuple) else ts.key
        return ts.loose_restrictions and str(key).startswith("dt-") or \
            str(key).startswith(PLACED_PREFIXES)

    stranded = []
    for ts in dask_scheduler.unrunnable:
        valid = dask_scheduler.valid_workers(ts)
        if valid is not None and not valid and placed(ts):
            stranded.append(ts)
    if stranded and dask_scheduler.running:
        for ts in stranded:
            ts.loose_restrictions = True
        dask_scheduler.transitions({ts.key: "processing" for ts in stranded},
                                   stimulus_id=f"dask-train-stranded-{time.time()}")
    left = sum(1 for ts in stranded if ts.state == "no-worker")
    return len(stranded) - left, left
