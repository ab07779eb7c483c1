"""Parameter-server shards: a flat slice of the parameters that trainers push gradients to.

A shard lives in a worker's :class:`~dask_train.runtime._plugin.WorkerJob` and is reached through
the ``dask_train_push`` / ``dask_train_pull`` RPC handlers defined here and registered with the
runtime's handler registry (installed lazily on every worker).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from distributed import Worker, get_worker
from distributed.protocol import to_serialize

from dask_train.checkpoint import read_slice
from dask_train.engines.harness.stats import StatsReporter, topic_of
from dask_train.engines.holders import host_memory
from dask_train.engines.holders.params import BUFFER_SHARD, ShardRef
from dask_train.engines.holders.reach import holder_or_reason
from dask_train.engines.holders.shard import ShardServer
from dask_train.models._buffers import BufferSet
from dask_train.models._frameworks import is_keras_model
from dask_train.models._torch import flatten_parameters
from dask_train.models._transport import unwrap
from dask_train.policy._settings import OptimizerSettings
from dask_train.runtime._denormals import call_flushed
from dask_train.runtime._plugin import worker_state


def start_shard_task(
    module: torch.nn.Module,
    *,
    job: str,
    shard: ShardRef,
    optim: OptimizerSettings,
    max_step: int | None,
    restore: Mapping[str, Any] | None = None,
    secret: bytes = b"",
) -> str:
    """Dask task: create one shard on this worker, from the module or from a checkpoint.

    ``restore`` is ``{"files": manifest shard records, "step": int, "samples": int}``: the shard
    loads its slice (parameters and optimizer state) from the checkpoint's files itself.
    ``secret`` is what a direct push connection must present (b"": none is accepted).
    """
    worker = get_worker()
    worker_state(worker).configure_torch()
    module = unwrap(module)
    held: Any
    if is_keras_model(module):  # read its variables; torch parameters are what it lacks
        from dask_train.models._keras import KerasBuffers, flatten_variables

        flat, held = flatten_variables(module), KerasBuffers(module)
    else:
        flat, held = flatten_parameters(module).numpy(), BufferSet(module)
    server = ShardServer(
        flat[shard.start : shard.stop], optim, max_step=max_step,
    )
    server.push_secret = secret
    if shard.index == BUFFER_SHARD:
        # One holder keeps the buffers (see BUFFER_SHARD); a model without any
        # leaves None, and its messages and files carry nothing more.
        server.buffers = held.gather()
    if restore is not None:
        state = read_slice(restore["files"], shard.start, shard.stop)
        server.restore(state, version=restore["step"], samples=restore["samples"])
        if shard.index != BUFFER_SHARD:
            # Its slice overlapped the file holding the buffers (the servers may be cut otherwise
            # than the checkpoint's); only the buffer holder keeps them, or a stale copy would
            # linger here.
            server.buffers = None
    if shard.segment and host_memory.enabled():
        # Trainers of this host update it themselves (see engines.holders.host_memory).
        server.to_host_memory(os.path.join(host_memory.SEGMENT_DIR, shard.segment), optim)
    # Counted from here: a restored shard's earlier updates are not this generation's.
    server.stats = StatsReporter(worker, topic=topic_of(job), role="ps", index=shard.index,
                                 start={"updates": server.version, "samples": server.samples})
    held_here = worker_state(worker).job(job).params
    earlier = held_here.get(shard.index)
    held_here[shard.index] = server
    if earlier is not None:
        earlier.close()  # an earlier generation's shard: its thread and its segment go
    return worker.address


def make_push_handler(worker: Worker) -> Any:
    """The ``dask_train_push`` handler: apply a gradient to a shard, reply with its parameters."""

    async def dask_train_push(
        job: str, shard: int, grad: np.ndarray, samples: int, position: Any = None,
        buffers: np.ndarray | None = None,
    ) -> dict[str, Any]:
        server = holder_or_reason(worker, job, shard)
        if isinstance(server, str):
            return {"missing": server}
        # Off the event loop for a large shard (see FlatOptimizer.run): a step of a big model
        # blocks for far longer than a heartbeat may wait. Denormals are flushed on the thread
        # the step runs on, the loop's only during the step (see runtime._denormals).
        params, version, stop = await server.run(call_flushed, server.apply, grad, samples,
                                                 position, buffers)
        return {"params": to_serialize(params), "version": version, "stop": stop}

    return dask_train_push
