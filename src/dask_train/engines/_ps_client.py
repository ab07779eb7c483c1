"""Talking to parameter-server shards from a role's thread: push gradients, pull parameters.

Calls are coroutines on the worker's event loop, started from the role's thread with
``run_coroutine_threadsafe`` so the next batch's computation overlaps the exchange. A shard on the
role's own worker is called directly, skipping serialization; its update or copy still runs off
the event loop when the shard is large (see ``FlatOptimizer.run``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from distributed import Worker
from distributed.protocol import to_serialize

from dask_train.runtime._plugin import JobState

#: The shard whose holder keeps the model's buffers. One holder, not a split across shards: the
#: buffers are small (BatchNorm statistics are a few values per channel, a tiny fraction of the
#: parameters), so splitting would balance nothing, and one holder keeps them as one consistent
#: vector, from one trainer's one push, and in one checkpoint file.
BUFFER_SHARD = 0


def _reply(reply: dict[str, Any]) -> dict[str, Any]:
    if "missing" in reply:
        raise KeyError(reply["missing"])
    return reply


@dataclass(frozen=True)
class ShardRef:
    """Where one shard lives: its slice of the flat vector and its worker's address."""

    index: int
    start: int
    stop: int
    address: str


@dataclass
class Exchange:
    """Parameters received from every shard after one push or pull."""

    params: list[tuple[ShardRef, np.ndarray]]
    version: int
    samples: int
    stop: bool
    buffers: np.ndarray | None = None  # the model's buffers (pulls only), None without any


class PSClient:
    """A role's handle on the job's shards.

    Parameters
    ----------
    worker : distributed.Worker
        The worker the role runs on.
    job : str
    state : JobState
        This worker's state of the job (for shards that live here).
    shards : sequence of ShardRef
    timeout : float
        Seconds to wait for any exchange.
    """

    def __init__(
        self, worker: Worker, job: str, state: JobState, shards: Sequence[ShardRef], timeout: float
    ) -> None:
        self.worker = worker
        self.job = job
        self.state = state
        self.shards = list(shards)
        self.timeout = timeout
        self.loop = worker.loop.asyncio_loop  # type: ignore[attr-defined]

    def _local(self, ref: ShardRef) -> Any:
        if ref.address == self.worker.address:
            return self.state.params.get(ref.index)
        return None

    async def _push(
        self, grad: torch.Tensor, samples: int, position: list[int] | None,
        buffers: np.ndarray | None,
    ) -> Exchange:
        # Every shard's exchange is started before any is awaited: remote shards and local large
        # ones (each on its own thread) update in parallel.
        calls = []
        for ref in self.shards:
            part = grad[ref.start : ref.stop].numpy()
            # Only to the holder that keeps them; a model without buffers sends nothing more.
            extra = buffers if ref.index == BUFFER_SHARD else None
            shard = self._local(ref)
            if shard is not None:
                calls.append((ref, asyncio.ensure_future(
                    shard.run(shard.apply, part, samples, position, extra)
                )))
            else:
                kwargs = {} if extra is None else {"buffers": to_serialize(extra)}
                call = self.worker.rpc(ref.address).dask_train_push(
                    job=self.job, shard=ref.index, grad=to_serialize(part), samples=samples,
                    position=position, **kwargs,
                )
                calls.append((ref, asyncio.ensure_future(call)))
        out, versions, stop = [], [], False
        for ref, fut in calls:
            got = await fut
            if isinstance(got, tuple):  # a local shard's (params, version, stop)
                params, version, s = got
            else:
                reply = _reply(got)
                params, version, s = reply["params"], reply["version"], reply["stop"]
            out.append((ref, params))
            versions.append(version)
            stop |= bool(s)
        return Exchange(out, min(versions), 0, stop)

    async def _pull(self) -> Exchange:
        calls = []
        for ref in self.shards:
            shard = self._local(ref)
            if shard is not None:
                calls.append((ref, asyncio.ensure_future(shard.run(shard.pull))))
            else:
                rpc = self.worker.rpc(ref.address)
                call = rpc.dask_train_pull(job=self.job, shard=ref.index)
                calls.append((ref, asyncio.ensure_future(call)))
        out, versions, samples, buffers = [], [], [], None
        for ref, fut in calls:
            got = await fut
            if isinstance(got, tuple):  # a local holder's (params, version, samples, buffers)
                params, version, n, held = got
            else:
                reply = _reply(got)
                params, version, n = reply["params"], reply["version"], reply["samples"]
                held = reply.get("buffers")
            out.append((ref, params))
            versions.append(version)
            samples.append(n)
            if ref.index == BUFFER_SHARD:
                buffers = held
        return Exchange(out, min(versions), min(samples), False, buffers)

    def push(
        self, grad: torch.Tensor, samples: int, position: list[int] | None = None,
        buffers: np.ndarray | None = None,
    ) -> concurrent.futures.Future[Exchange]:
        """Start pushing a flat gradient to every shard; the future holds the new parameters.

        ``grad`` must not be modified until the future is done (callers double-buffer it).
        ``position`` (trainer, epoch, block, rows) lets the servers record what they have applied.
        ``buffers`` (a new array, from ``BufferSet.gather``) go to the holder that keeps them.
        """
        return asyncio.run_coroutine_threadsafe(
            self._push(grad, samples, position, buffers), self.loop)

    def pull(self) -> Exchange:
        """Pull the current parameters of every shard (blocking, with the timeout)."""
        return asyncio.run_coroutine_threadsafe(self._pull(), self.loop).result(self.timeout)

    def wait(self, fut: concurrent.futures.Future[Exchange]) -> Exchange:
        """Wait for a push started with :meth:`push`."""
        return fut.result(self.timeout)


def write_params(model: Any, exchange: Exchange) -> None:
    """Copy the shards' parameters into a model adapter's flat parameters (on its device)."""
    model.write_slices([(ref.start, ref.stop, params) for ref, params in exchange.params])
