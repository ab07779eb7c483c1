"""Talking to parameter-server shards from a role's thread: push gradients, pull parameters.

Calls are coroutines on the worker's event loop, started from the role's thread with
``run_coroutine_threadsafe`` so the next batch's computation overlaps the exchange. A shard on the
role's own worker is called directly, skipping serialization; its update or copy still runs off
the event loop when the shard is large (see ``FlatOptimizer.run``). A small remote shard gets its
pushes over a direct connection from the role's thread (:mod:`.push_socket`), where a round trip
costs a fraction of Dask's RPC.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from distributed import Worker
from distributed.protocol import to_serialize

from dask_train.engines.holders import host_memory
from dask_train.engines.holders.push_socket import PushConnection, connection_error
from dask_train.engines.holders.ref import ShardRef
from dask_train.engines.holders.shard import ShardServer
from dask_train.runtime._plugin import WorkerJob

logger = logging.getLogger(__name__)

#: The shard whose holder keeps the model's buffers. One holder, not a split across shards: the
#: buffers are small (BatchNorm statistics are a few values per channel, a tiny fraction of the
#: parameters), so splitting would balance nothing, and one holder keeps them as one consistent
#: vector, from one trainer's one push, and in one checkpoint file.
BUFFER_SHARD = 0

#: Remote shards up to this many elements (2**17 float32 = 512 KiB) get their pushes over a direct
#: connection. A round trip there is latency, which the connection cuts (2.2-3.2 ms through Dask's
#: RPC against ~0.5 ms for a 30 KB gradient); a larger push is bandwidth, and Dask's RPC sends it
#: from the event loop while the trainer computes its next gradient, where a blocking send from
#: the trainer's thread would not overlap.
DIRECT_MAX_ELEMENTS = 1 << 17


def _reply(reply: dict[str, Any]) -> dict[str, Any]:
    if "missing" in reply:
        raise KeyError(reply["missing"])
    return reply


@dataclass
class PendingPush:
    """A push in flight: the direct connections it was sent on, and the rest's future."""

    direct: list[tuple[ShardRef, PushConnection]]
    future: concurrent.futures.Future[Exchange] | None
    applied: list[tuple[ShardRef, tuple[np.ndarray, int, bool]]]


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
    state : WorkerJob
        This worker's state of the job (for shards that live here).
    shards : sequence of ShardRef
    timeout : float
        Seconds to wait for any exchange.
    secret : bytes
        The generation's push secret: pushes go over direct connections only with it (a role
        that only pulls, the scorer, has none and needs none).
    """

    def __init__(
        self, worker: Worker, job: str, state: WorkerJob, shards: Sequence[ShardRef],
        timeout: float, secret: bytes = b"",
    ) -> None:
        self.secret = secret
        self.worker = worker
        self.job = job
        self.state = state
        self.shards = list(shards)
        self.timeout = timeout
        self.loop = worker.loop.asyncio_loop  # type: ignore[attr-defined]
        self._direct: dict[int, PushConnection | None] = {}
        self._host: dict[int, ShardServer | None] = {}  # shards mapped from host memory

    def _local(self, ref: ShardRef) -> Any:
        """The shard's state when this process can update it itself: it lives here, or in a
        segment of this host's memory (mapped on first use); else None (over the network)."""
        if ref.address == self.worker.address:
            return self.state.params.get(ref.index)
        if ref.index not in self._host:
            shard = None
            if ref.segment and host_memory.same_host(ref.address, self.worker.address) \
                    and host_memory.enabled():
                shard = ShardServer.attach(os.path.join(host_memory.SEGMENT_DIR, ref.segment))
            self._host[ref.index] = shard
        return self._host[ref.index]

    def _connection(self, ref: ShardRef) -> PushConnection | None:
        """The direct connection for pushes to ``ref``, opened on first use; None for a shard
        on this worker, a large one, or a worker that keeps Dask's RPC."""
        if ref.index in self._direct:
            return self._direct[ref.index]
        conn = None
        if ref.address != self.worker.address and ref.stop - ref.start <= DIRECT_MAX_ELEMENTS:
            try:
                endpoint = asyncio.run_coroutine_threadsafe(
                    self.worker.rpc(ref.address).dask_train_endpoint(), self.loop
                ).result(self.timeout)
                if endpoint and self.secret:
                    conn = PushConnection(endpoint, self.job, ref.index, self.timeout,
                                          self.secret)
            except (OSError, TimeoutError) as exc:
                # Dask's RPC still works, or fails with its own clear error.
                logger.debug("no direct push connection to %s: %s", ref.address, exc)
        self._direct[ref.index] = conn
        return conn

    async def _push(
        self, grad: torch.Tensor, samples: int, position: list[int] | None,
        buffers: np.ndarray | None, shards: Sequence[ShardRef],
    ) -> Exchange:
        # Every shard's exchange is started before any is awaited: remote shards and local large
        # ones (each on its own thread) update in parallel.
        calls = []
        for ref in shards:
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
    ) -> PendingPush:
        """Start pushing a flat gradient to every shard; :meth:`wait` returns the new parameters.

        ``grad`` must not be modified until then (callers double-buffer it). ``position``
        (trainer, epoch, block, rows) lets the servers record what they have applied.
        ``buffers`` (a new array, from ``BufferSet.gather``) go to the holder that keeps them.
        """
        direct, rest, applied = [], [], []
        for ref in self.shards:
            shard = self._local(ref)
            if shard is not None and (not shard.off_loop
                                      or getattr(shard, "in_host_memory", False)):
                # A small shard here, or any in host memory: updated in this thread, without a
                # hop to the event loop and back (its lock serializes it with the other pushes).
                gone = shard.server_gone() if hasattr(shard, "server_gone") else None
                if gone is not None:
                    raise connection_error(ConnectionResetError(
                        f"its server's process ({gone}) is gone"), ref.index, ref.address)
                extra = buffers if ref.index == BUFFER_SHARD else None
                part = grad[ref.start : ref.stop].numpy()
                view = getattr(shard, "in_host_memory", False)  # copied into the model at once
                applied.append((ref, shard.apply(part, samples, position, extra, view=view)))
                continue
            conn = self._connection(ref)
            if conn is None:
                rest.append(ref)
                continue
            extra = buffers if ref.index == BUFFER_SHARD else None
            try:
                conn.send(grad[ref.start : ref.stop].numpy(), samples, position, extra)
            except OSError as exc:
                raise connection_error(exc, ref.index, ref.address) from exc
            direct.append((ref, conn))
        future = asyncio.run_coroutine_threadsafe(
            self._push(grad, samples, position, buffers, rest), self.loop) if rest else None
        return PendingPush(direct, future, applied)

    def pull(self) -> Exchange:
        """Pull the current parameters of every shard (blocking, with the timeout)."""
        return asyncio.run_coroutine_threadsafe(self._pull(), self.loop).result(self.timeout)

    def wait(self, pending: PendingPush) -> Exchange:
        """Wait for a push started with :meth:`push`."""
        out, versions, stop = [], [], False
        for ref, (params, version, s) in pending.applied:
            out.append((ref, params))
            versions.append(version)
            stop |= s
        for ref, conn in pending.direct:
            try:
                params, version, s = conn.receive()
            except OSError as exc:
                raise connection_error(exc, ref.index, ref.address) from exc
            out.append((ref, params))
            versions.append(version)
            stop |= s
        if pending.future is not None:
            rest = pending.future.result(self.timeout)
            out += rest.params
            versions.append(rest.version)
            stop |= rest.stop
        return Exchange(out, min(versions), 0, stop)

    def in_host_memory(self) -> list[int]:
        """The shards this role updates in host memory: in a segment mapped here, or its own
        process's shard when that is in a segment too (a trainer reports them)."""
        return sorted(ref.index for ref in self.shards
                      if getattr(self._local(ref), "in_host_memory", False))

    def close(self) -> None:
        """Close the direct connections (their server threads end)."""
        for conn in self._direct.values():
            if conn is not None:
                conn.close()
        self._direct.clear()
        for shard in self._host.values():
            if shard is not None:
                shard.close()
        self._host.clear()


def write_params(model: Any, exchange: Exchange) -> None:
    """Copy the shards' parameters into a model adapter's flat parameters (on its device)."""
    model.write_slices([(ref.start, ref.stop, params) for ref, params in exchange.params])
