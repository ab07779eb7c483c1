"""A worker's connect to a peer that left is given up once the job sees the peer gone.

A worker told in one message batch to fetch a block from a peer and that the peer left starts
the fetch after it dropped that peer, and Dask retries its connect to the dead address for the
connect timeout (30 s): the block waits for it, and so does the trainer it feeds. The worker's
story in such a run (an async trainer fed nothing for 30 s after a worker was killed):
``flight -> cancelled`` on the worker's removal, ``cancelled -> resumed`` on the compute
request, and then the ``request-dep`` to the dead worker. Each liveness pass gives up the
survivors' connections to workers that left (``drop_fetches_from``).
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

from distributed import Client

from dask_train.data._cluster import live_workers
from dask_train.data._stall import drop_fetches_from


def _closed_port() -> str:
    with socket.socket() as s:  # bound and closed: connects are refused, as to a killed worker
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def _connect_then_drop(address: str, dask_worker: Any = None) -> dict[str, Any]:
    started = time.monotonic()
    attempt = asyncio.ensure_future(dask_worker.rpc.connect(address))
    await asyncio.sleep(1.0)
    retrying = not attempt.done()  # refused, and tried again until the connect timeout
    held = drop_fetches_from([address], dask_worker=dask_worker)
    try:
        await asyncio.wait_for(attempt, timeout=20.0)
        outcome = "connected"
    except Exception as exc:  # noqa: BLE001 - which one is the answer
        outcome = type(exc).__name__
    return {"retrying": retrying, "held": held, "outcome": outcome,
            "seconds": time.monotonic() - started}


def test_a_connect_to_a_worker_that_left_is_given_up_at_once(client: Client) -> None:
    address = sorted(live_workers(client))[0]
    dead = _closed_port()
    answer = client.run(_connect_then_drop, dead, workers=[address])[address]
    assert answer["retrying"], "the premise: a connect to a closed port is retried"
    assert answer["held"] == 1
    # Given up: the pool's close of the attempt. Left to Dask, it ends after the connect
    # timeout (30 s by default) in an OSError "Timed out trying to connect".
    assert answer["outcome"] == "CommClosedError", answer


def test_workers_not_connected_to_the_address_hold_nothing(client: Client) -> None:
    answers = client.run(drop_fetches_from, [_closed_port()])
    assert answers and set(answers.values()) == {0}
