"""Calls from the client to the workers that must never wait on a dead one."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from distributed import Client
from distributed.protocol.pickle import dumps

# Asked of the scheduler by the data layer too: defined there, one function for both.
from dask_train.data._cluster import live_workers as live_workers
from dask_train.errors import InvalidInput
from dask_train.runtime._cluster_view import LEAVING_STATES as LEAVING_STATES
from dask_train.runtime._cluster_view import look
from dask_train.runtime._hosts import split_endpoint


async def alive_workers(client: Client, *, placeable: bool = False) -> dict[str, int]:
    """Live Dask workers and their thread counts, as the scheduler sees them now (those of the
    current job's scope, see :func:`~dask_train.policy._scope.use_workers`).

    ``placeable``: only those that may take a new role, not those on their way out (retiring,
    closing after a SIGTERM), which the scheduler still lists for a moment.
    """
    view = await look(client)
    return view.placeable() if placeable else view.alive()


#: The scheduler's events of a worker it was asked to retire (``retire_workers``: a
#: scale-down, ``dask worker --lifetime``, an adaptive cluster), whether it could or not.
_RETIRE_ACTIONS = frozenset({"retired", "could-not-retire"})


async def asked_to_retire(client: Client, addresses: Iterable[str]) -> set[str]:
    """Those of ``addresses`` that left with notice as the scheduler's own events of each
    worker say: asked to retire, or removed as expected. Such a worker may close before any
    job holds it (it had no role's state yet) and so never announces itself to a job."""
    found = set()
    for address in set(addresses):
        try:
            events = await client.scheduler.events(topic=address)
        except Exception:  # noqa: BLE001 - no answer: taken for a loss without notice
            continue
        for _, msg in events or ():
            if isinstance(msg, dict) and (msg.get("action") in _RETIRE_ACTIONS or
                                          msg.get("action") == "remove-worker" and
                                          msg.get("expected")):
                found.add(address)
                break
    return found


#: A direct call's answer from a worker that is gone (left out of :func:`run_on_live`'s).
_GONE = object()

#: How often a call to the workers looks whether one of them died meanwhile.
CHECK_S = 0.5


async def run_direct(client: Client, fn: Any, *args: Any, address: str, **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)`` on the worker at ``address`` straight through its own RPC
    server, not through the scheduler; ``fn`` gets ``dask_worker=`` when it takes one.

    Why: a worker that is leaving with notice (``retire_workers``, ``--lifetime``, a scale-down)
    is already removed from the scheduler while it closes, so ``client.run`` no longer reaches
    it; its server still answers while dask-train's worker plugin holds it for a hand-over
    (:mod:`dask_train.runtime._plugin`). Raises the function's error, or ``OSError`` when the
    worker is gone.
    """
    response = await client.rpc(address).run(function=dumps(fn), args=dumps(args),
                                              kwargs=dumps(kwargs), wait=True)
    if response.get("status") != "OK":
        raise RuntimeError(f"on the leaving worker {address}: {response.get('exception_text')}")
    return response.get("result")


async def listens(address: str, timeout: float = 2.0) -> bool:
    """Whether something still accepts connections at a worker's address (a held worker does;
    a killed one's port refuses at once, a dead host's times out).

    The kernel accepts the connection even while the worker's process is busy, so only a dead
    host waits out ``timeout``; it is seconds, not a fraction: on a loaded machine this
    process's own event loop took more than 0.2 s to see a live worker's answer, and a held
    worker was taken for gone (its hand-over failed: a SIGTERMed worker's, under load)."""
    if "://" in address and not address.startswith(("tcp://", "tls://")):
        return False
    try:
        host, port = split_endpoint(address)
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (InvalidInput, OSError, ValueError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


async def run_on_live(client: Client, fn: Any, *args: Any, workers: Sequence[str],
                      leaving: Collection[str] = (), **kwargs: Any) -> Any:
    """``client.run`` on those of ``workers`` still alive.

    Those of ``workers`` in ``leaving`` (removed from the scheduler but held for a hand-over)
    are called directly (:func:`run_direct`), together; a failed direct call is left out of the
    answer, and so is a leaving worker whose port no longer :func:`listens`: a call to a killed
    one went through distributed's connect retries until the 10 s bound, per worker, and a
    failed hand-over of a whole cluster killed while held (a pause, then a resume, to each) took
    40 s.

    A call to a dead worker's address waits for the 30 s connect timeout even with
    ``on_error="ignore"``: never send one. A worker killed just as the call goes out is still
    on the scheduler's list; so while the call runs, the list is asked again every
    :data:`CHECK_S` seconds, and once a target has left, the call is sent again to the live
    ones (every function sent here may run twice: they set flags or read).
    """
    async def direct_call(address: str) -> tuple[str, Any]:
        # Only a TCP port can be looked at so (an in-process or UCX worker is called as is).
        if address.startswith(("tcp://", "tls://")) and not await listens(address):
            return address, _GONE
        try:
            return address, await asyncio.wait_for(
                run_direct(client, fn, *args, address=address, **kwargs), timeout=10.0)
        except Exception:  # gone meanwhile: a loss, for the caller's failure check
            return address, _GONE

    direct: dict[str, Any] = {}

    async def call_directly(addresses: list[str]) -> None:
        answers = await asyncio.gather(*(direct_call(w) for w in addresses))
        direct.update({address: answer for address, answer in answers if answer is not _GONE})

    await call_directly([w for w in workers if w in leaving])
    workers = [w for w in workers if w not in leaving]
    while True:
        listed = (await look(client)).workers
        # One retiring or closing (still listed) is called directly too: the scheduler's
        # broadcast to a worker that closes as it connects waits out the 30 s connect timeout
        # and logs an ERROR (seen after a scale-down), whatever on_error says.
        closing = [w for w in workers if w in listed and listed[w].leaving]
        if closing:
            await call_directly(closing)
            workers = [w for w in workers if w not in closing]
        targets = [w for w in workers if w in listed]
        if not targets:
            return direct
        call = asyncio.ensure_future(client.run(fn, *args, workers=targets, asynchronous=True,
                                                on_error="ignore", **kwargs))
        while True:
            done, _ = await asyncio.wait({call}, timeout=CHECK_S)
            if done:
                return {**call.result(), **direct}
            alive = await alive_workers(client)
            if any(w not in alive for w in targets):
                call.cancel()
                break
