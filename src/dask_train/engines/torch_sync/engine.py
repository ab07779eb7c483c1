"""The synchronous torch engine, client side: a torch process group over the trainers' workers,
one rank per worker. Worker code: :mod:`.rank` (ranks); their gradients are combined by
:mod:`dask_train.engines.collectives`."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from typing import Any

from dask_train.engines._protocol import Regrouping, Snapshot, Survivable
from dask_train.engines._spec import RoleConfig
from dask_train.engines.harness import control as worker_side
from dask_train.engines.holders.ref import ShardRef
from dask_train.engines.roles.base import RoleEngine
from dask_train.policy._ledger import patch_positions
from dask_train.runtime._calls import run_on_live
from dask_train.runtime._devices import group_backend
from dask_train.runtime._torch_group import start_torch

logger = logging.getLogger(__name__)


#: How long the survivors of a killed rank get to end their step: their collective fails
#: within milliseconds of the loss (gloo's sockets close, the host-memory sum checks its peers'
#: processes), an NCCL one may hang. Past it, the job restarts from its stored checkpoint.
SETTLE_S = 2.0


class TorchSyncEngine(RoleEngine, Survivable, Regrouping):
    """Ranks all-reduce their gradients every step; rank 0 publishes the parameters.

    A process group's size is fixed: workers that joined come in a new one (:class:`Regrouping`).
    """

    strategy = "sync"
    group: Any = None

    @staticmethod
    def run_trainer(*args: Any, **kwargs: Any) -> Any:
        """Dask task: one rank (:func:`~dask_train.engines.torch_sync.rank.run_rank`), imported
        on the worker: the controller's process needs no torch for it."""
        from dask_train.engines.torch_sync.rank import run_rank

        return run_rank(*args, **kwargs)

    def make_shards(self) -> list[ShardRef]:
        """Rank 0's parameters, the only copy the scorer and the controller read."""
        return [ShardRef(0, 0, self.spec.n_params, self.roles["trainer"][0])]

    async def start_servers(self) -> None:
        """Start the torch process group on the ranks' workers: NCCL on GPUs, gloo on CPUs and
        where ranks share a GPU (:func:`~dask_train.runtime._devices.group_backend`)."""
        backend = group_backend(self.spec.device_kind, self.spec.devices, self.roles["trainer"])
        if backend == "gloo" and self.spec.device_kind == "cuda":
            logger.info("the ranks share GPUs (more workers than GPUs on a host): gloo, not NCCL, "
                        "sums their gradients, through host memory")
        # start_torch is the blocking API: run it in a thread so this loop keeps serving it.
        call = functools.partial(start_torch, self.client, workers=self.roles["trainer"],
                                 backend=backend, timeout=self.spec.timeout)
        self.group = await asyncio.get_running_loop().run_in_executor(None, call)

    def trainer_config(self) -> RoleConfig:
        """Every rank loads the checkpoint itself: each applies the same updates with its own
        optimizer, so each needs the optimizer state, not only the parameters."""
        restore = self.restore
        return dataclasses.replace(super().trainer_config(), restore=None if restore is None else {
            "files": restore["files"], "step": restore["step"], "samples": restore["samples"]})

    async def survivors(self, lost: set[str]) -> Snapshot | None:
        """The surviving ranks' state at the last step every rank applied: each rank holds the
        parameters and optimizer state, and every rank's data position travels with each
        step's gradients (``GradientReducer.positions``). :meth:`save` then writes from the
        survivor that got furthest."""
        ranks = {i: a for i, a in enumerate(self.roles["trainer"]) if a not in lost}
        if not ranks or len(self.trainer_futures) < len(self.roles["trainer"]):
            return None  # lost while starting: no step was applied by this generation
        # Wait for their steps to end: a step whose collective got the lost rank's part before
        # it died still completes, and the held point moves with it.
        deadline = time.monotonic() + SETTLE_S
        while any(self.trainer_futures[i].status == "pending" for i in ranks):
            if time.monotonic() > deadline:
                logger.info("job %s: the surviving ranks did not end their step within %g s",
                            self.job, SETTLE_S)
                return None
            await asyncio.sleep(0.01)
        points = await run_on_live(self.client, worker_side.held_point, self.job,
                                   workers=list(ranks.values()), leaving=self.leaving_workers)
        held = [(point["version"], i) for i, a in ranks.items()
                if isinstance(point := points.get(a), dict) and point["positions"] is not None]
        if not held:
            return None
        version, rank = max(held)
        # A rank reports a block once it has read past it; a report from a step the survivors
        # did not apply (the lost rank was a step ahead) counts rows their state lacks.
        if max(self.trainer_steps.values(), default=0) > version:
            logger.info("job %s: a rank reported step %d, past the survivors' step %d",
                        self.job, max(self.trainer_steps.values()), version)
            return None
        address = ranks[rank]
        self.shards = [ShardRef(0, 0, self.spec.n_params, address)]
        positions = dict(enumerate(points[address]["positions"]))
        return Snapshot(step=int(version), ledger=patch_positions(self.ledger.state(), positions))

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
