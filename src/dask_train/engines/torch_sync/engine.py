"""The synchronous torch engine, client side: a torch process group over the trainers' workers,
one rank per worker. Worker code: :mod:`.rank` (ranks); their gradients are combined by
:mod:`dask_train.engines.collectives`."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from typing import Any

from dask_train.engines._spec import RoleConfig
from dask_train.engines.holders.params import ShardRef
from dask_train.engines.roles.base import RoleEngine
from dask_train.engines.torch_sync.rank import run_rank
from dask_train.runtime._torch_group import start_torch

logger = logging.getLogger(__name__)


class TorchSyncEngine(RoleEngine):
    """Ranks all-reduce their gradients every step; rank 0 publishes the parameters."""

    strategy = "sync"
    grows_by_regroup = True  # a process group's size is fixed: joiners come in a new one
    run_trainer = staticmethod(run_rank)
    group: Any = None

    def make_shards(self) -> list[ShardRef]:
        """Rank 0's parameters, the only copy the scorer and the controller read."""
        return [ShardRef(0, 0, self.spec.n_params, self.roles["worker"][0])]

    async def start_servers(self) -> None:
        """Start the torch process group on the ranks' workers: NCCL on GPUs, gloo on CPUs."""
        backend = "nccl" if self.spec.device_kind == "cuda" else "gloo"
        # start_torch is the blocking API: run it in a thread so this loop keeps serving it.
        call = functools.partial(start_torch, self.client, workers=self.roles["worker"],
                                 backend=backend, timeout=self.spec.timeout)
        self.group = await asyncio.get_running_loop().run_in_executor(None, call)

    def trainer_config(self) -> RoleConfig:
        """Every rank loads the checkpoint itself: each applies the same updates with its own
        optimizer, so each needs the optimizer state, not only the parameters."""
        restore = self.restore
        return dataclasses.replace(super().trainer_config(), restore=None if restore is None else {
            "files": restore["files"], "step": restore["step"], "samples": restore["samples"]})

    async def close(self) -> None:
        """Close the generation, then its process group."""
        await super().close()
        if self.group is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.group.close)
        except Exception:  # ranks on a dead worker cannot be closed; the others were
            logger.info("closing the torch group after a failure", exc_info=True)
        self.group = None
