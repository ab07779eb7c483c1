"""How a role engine hands blocks to its trainers: the ledger's next block for a trainer, by one
RPC to its worker when the block is already there, by a pinned task when it must move (Dask brings
it), sent again from the client when in-memory input was lost with its worker; end markers once
the data is handed out.

The queue is bounded by credit: a trainer holds at most ``blocks_ahead`` blocks it has not yet
reported consumed, and each report grants the next (see ``RoleEngine._on_event``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from distributed import Client, Future

from dask_train.data._blocks import BlockSet
from dask_train.engines._spec import JobSpec
from dask_train.policy._ledger import Ledger
from dask_train.policy._placement import Roles
from dask_train.runtime._enqueue import feed_block


class BlockGranting:
    """The feeding half of :class:`~dask_train.engines.shared.role_engine.RoleEngine`."""

    # Set by RoleEngine.__init__ (declared here for the type checker).
    client: Client
    spec: JobSpec
    roles: Roles
    blocks: BlockSet
    ledger: Ledger
    job: str
    stopping: bool
    ended: list[bool]
    idle: list[bool]
    retired: set[int]
    sequence: list[int]
    feeds: list[tuple[int, Future]]
    direct_feeds: set[asyncio.Task[None]]
    pinned: Callable[..., Future]

    def live(self) -> list[int]:
        """Trainers not lost (retired)."""
        return [i for i in range(len(self.roles["worker"])) if i not in self.retired]

    def _grant(self, trainer: int) -> None:
        """Hand ``trainer`` its next block, or the end marker once every epoch is handed out."""
        if self.ended[trainer] or trainer in self.retired or self.stopping:
            return
        a = self.ledger.next_for(trainer)
        if a is None and self.out_of_blocks(trainer):
            return
        self.idle[trainer] = False
        address = self.roles["worker"][trainer]
        common = self._common(trainer)
        if a is None:
            self.ended[trainer] = True
            fut = self.pinned(feed_block, None, address=address, key=f"dt-end-{trainer}",
                              epoch=-1, block=-1, **common)
        elif a.local and self._feed_direct(trainer, address, a, common):
            return
        elif self.blocks.lost(a.block):
            self._rescatter_then_feed(trainer, address, a, common)
            return
        else:
            fut = self._feed_task(trainer, address, a, common)
        self.feeds.append((trainer, fut))

    def out_of_blocks(self, trainer: int) -> bool:
        """``trainer`` has no block left to get: True when the engine takes care of it, False to
        send it the end marker now (a sync rank ends with the others; the async engine overrides
        this to keep it waiting while a lost trainer's blocks may still come back to it)."""
        return False

    def _common(self, trainer: int) -> dict[str, Any]:
        common = {"job": self.job, "trainer": trainer, "seed": self.spec.seed,
                  "shuffle": self.spec.shuffle, "seq": self.sequence[trainer]}
        self.sequence[trainer] += 1
        return common

    def _feed_task(self, trainer: int, address: str, a: Any, common: dict[str, Any]) -> Future:
        return self.pinned(
            feed_block, self.blocks.futures[a.block], address=address,
            key=f"dt-feed-{a.epoch}-{a.block}-{trainer}", epoch=a.epoch, block=a.block,
            skip=a.skip, **common)

    def _rescatter_then_feed(self, trainer: int, address: str, a: Any,
                             common: dict[str, Any]) -> None:
        """In-memory input whose worker was lost (Dask cannot recompute scattered data): send the
        block from the client again, then feed it by task."""

        async def send() -> None:
            await self.blocks.rescatter(self.client, a.block)
            if not self.stopping:
                self.feeds.append((trainer, self._feed_task(trainer, address, a, common)))

        task = asyncio.get_running_loop().create_task(send())
        self.direct_feeds.add(task)
        task.add_done_callback(self.direct_feeds.discard)

    def _feed_direct(self, trainer: int, address: str, a: Any, common: dict[str, Any]) -> bool:
        """Queue a local block by one RPC to its worker; False when there is no loop to run it."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False

        async def send() -> None:
            try:
                rows = await self.client.rpc(address).dask_train_feed(
                    key=self.blocks.futures[a.block].key, epoch=a.epoch, block=a.block,
                    skip=a.skip, **common)
            except Exception:  # a lost worker or a broken connection: the task path decides
                rows = -1
            if rows < 0 and not self.stopping:
                # The block left that worker (or never was there): a task brings it.
                if self.blocks.lost(a.block):
                    await self.blocks.rescatter(self.client, a.block)
                self.feeds.append((trainer, self._feed_task(trainer, address, a, common)))

        task = loop.create_task(send())
        self.direct_feeds.add(task)  # a reference, or the task could be collected mid-flight
        task.add_done_callback(self.direct_feeds.discard)
        return True

    def _end_idle(self) -> None:
        """Send end markers to idle trainers once every block handed out has been consumed."""
        live = self.live()
        if not all(self.idle[i] for i in live) or not self.ledger.all_reported():
            return
        for i in live:
            self.idle[i] = False
            self.ended[i] = True
            fut = self.pinned(feed_block, None, address=self.roles["worker"][i],
                              key=f"dt-end-{i}", epoch=-1, block=-1, **self._common(i))
            self.feeds.append((i, fut))
