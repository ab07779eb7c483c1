"""The async parameter-server engine, client side: servers, trainers, and what a lost trainer
or a joining worker changes. Worker code: :mod:`.trainer` (trainers), :mod:`.server` (shards)."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Mapping

from dask_train.data._cluster import declared_resources
from dask_train.engines._protocol import Elastic
from dask_train.engines._spec import RoleConfig
from dask_train.engines.harness import control as worker_side
from dask_train.engines.holders import host_memory
from dask_train.engines.holders.push_socket import SECRET_BYTES
from dask_train.engines.holders.ref import ShardRef
from dask_train.engines.ps.server import start_shard_task
from dask_train.engines.ps.trainer import run_trainer
from dask_train.engines.roles.base import RoleEngine
from dask_train.engines.roles.granting import Granter
from dask_train.models._torch import split_shards
from dask_train.runtime._calls import run_on_live

logger = logging.getLogger(__name__)


class AsyncPSEngine(RoleEngine, Elastic):
    """Trainers push gradients to ``ps`` parameter servers holding balanced flat shards."""

    strategy = "async-ps"
    run_trainer = staticmethod(run_trainer)

    def make_shards(self) -> list[ShardRef]:
        """Balanced contiguous slices, one per server (and the generation's push secret: random,
        never derived from the job id, which the scheduler's /metrics shows)."""
        self.push_secret = secrets.token_bytes(SECRET_BYTES)
        servers = self.roles["ps"]
        # Each generation's segments get new names: a lost server's file is never reused.
        token = secrets.token_hex(8)
        return [ShardRef(s.index, s.start, s.stop, servers[s.index],
                         segment=f"{host_memory.PREFIX}{token}-{s.index}")
                for s in split_shards(self.spec.n_params, len(servers))]

    def trainer_config(self) -> RoleConfig:
        """The trainers also get the generation's push secret (see ``holders.push_socket``)."""
        return dataclasses.replace(super().trainer_config(), push_secret=self.push_secret)

    async def start_servers(self) -> None:
        """One shard per server, from the module or from the checkpoint's files."""
        train, restore = self.train, self.restore
        server_restore = None if restore is None else {
            "files": restore["files"], "step": restore["step"], "samples": restore["samples"]}
        starts = [
            self.pinned(start_shard_task, self.module_f, address=ref.address,
                        key=f"dt-ps-{ref.index}", job=self.job, shard=ref,
                        optim=train.optim, max_step=self.spec.max_step, restore=server_restore,
                        secret=self.push_secret)
            for ref in self.shards
        ]
        # A server's worker lost while it starts (a second loss while the job restarts) ends
        # the wait at once with WorkerLost, for the controller to restart again.
        await self.tasks.wait_for_holders(starts, what="starting the parameter servers")

    #: No end marker yet: until every block is consumed, a lost trainer's blocks may still
    #: come back to a trainer out of blocks.
    out_of_blocks = Granter.wait_idle

    def reported_step(self) -> int:
        """Every trainer's push is one server update: the restored step plus all pushes."""
        base = int(self.restore["step"]) if self.restore is not None else 0
        return base + sum(self.trainer_steps.values())

    async def retire_trainer(self, index: int) -> None:
        """Move a lost trainer's unconsumed rows to the survivors, minus the rows the servers
        already applied (they remember each trainer's last few blocks)."""
        ref = self.shards[0]
        positions = await run_on_live(self.client, worker_side.shard_positions, self.job,
                                      ref.index, index, workers=[ref.address],
                                      leaving=self.leaving_workers)
        seen = positions.get(ref.address)
        applied = {(int(e), int(b)): int(rows) for e, b, rows in
                   (seen if isinstance(seen, list) else [])}
        moved = self.ledger.retire(index, applied)
        stale = [*self.granter.retire(index), self.trainer_futures[index]]
        await self.client.cancel(stale, asynchronous=True)
        logger.warning("trainer %d retired; %d blocks moved to the survivors", index, len(moved))

    async def adopt_workers(self, alive: Mapping[str, int]) -> None:
        """A worker that joined (a restarted one too) gets a trainer, up to ``workers`` (its
        most, for ``workers=(least, most)``; every worker for None)."""
        # Only a worker that declares the job's resources takes a trainer (see Placement).
        alive = self.spec.placement.usable(alive, declared_resources(self.client))
        live = self.live()
        cap = self.spec.trainer_cap
        room = len(alive) if cap is None else cap - len(live)
        if self.stopping or room <= 0 or \
                all(self.granter.ended[i] or self.granter.idle[i] for i in live):
            return
        # Workers without a live trainer (a replaced scorer may already run on a new worker).
        used = {self.roles["trainer"][i] for i in live}
        await self.module_again()
        for address in [a for a in sorted(alive) if a not in used][:room]:
            index = self.ledger.add_trainer(address)
            self.roles = self.roles.replace("trainer", [*self.roles["trainer"], address])
            granted = self.granter.add_trainer(address)
            assert index == len(self.roles["trainer"]) - 1 == granted
            self.trainer_futures.append(self._trainer_task(index, address))
            for _ in range(self.spec.blocks_ahead):
                self.granter.grant(index)
            logger.info("job %s: trainer %d joined on %s", self.job, index, address)
