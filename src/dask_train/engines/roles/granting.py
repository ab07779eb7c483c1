"""How a role engine hands blocks to its trainers: the ledger's next block for a trainer, by one
RPC to its worker when the block is already there, by a pinned task when it must move (Dask brings
it) or is streamed (the task reads it there, see :mod:`dask_train.data._stream`), sent again from
the client when in-memory input was lost with its worker; end markers once the data is handed out.

The queue is bounded by credit: a trainer holds at most ``blocks_ahead`` blocks it has not yet
reported consumed, and each report grants the next (see ``RoleEngine._on_event``). Streamed with
``blocks_ahead="auto"``, a trainer that reports it waited for a block (and has the memory for one
more) gets one more credit, up to ``most_ahead``: reading ahead deepens only where reads, not the
trainer, were the bottleneck.
A :class:`Granter` owns that state (what each trainer was sent, which are idle, ended or
retired); its engine holds one and calls it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from distributed import Client, Future

from dask_train.data._blocks import BlockSet
from dask_train.policy._ledger import Ledger
from dask_train.runtime._calls import run_direct
from dask_train.runtime._enqueue import feed_block


def pin(client: Client, generation: str, fn: Any, /, *args: Any, address: str, key: str,
        retries: int = 0, resources: dict[str, float] | None = None, **kwargs: Any) -> Future:
    """Submit ``fn`` to run exactly once on ``address``, under a key of ``generation`` (a job's
    key on the workers; ``kwargs`` go to ``fn``, ``job=`` among them).

    Pinned with no fallback: a role's state lives on that worker. ``pure=False``: each call has
    side effects. retries stay 0 for roles: a lost role is the controller's decision, not a
    silent re-run elsewhere; a streamed block's feed is tried ``retries`` more times, on the same
    worker, when its read fails (it queues nothing before the read succeeded). ``resources``:
    the Dask worker resources the task holds while it runs (a trainer's, see
    :class:`~dask_train.policy._placement.Placement`); the job's other tasks ask for none.
    """
    return client.submit(fn, *args, workers=[address], allow_other_workers=False, pure=False,
                         retries=retries or None, key=f"{key}-{generation}",
                         resources=resources, **kwargs)


class Granter:
    """Hands each trainer of one generation its blocks, in the ledger's order.

    Parameters
    ----------
    client : distributed.Client
    blocks : BlockSet
        The training blocks, persisted or streamed: a feed task takes what
        :meth:`BlockSet.block_input` gives, and only a persisted block local to its trainer
        takes the one-RPC path.
    ledger : Ledger
        The data position: which block each trainer gets next, and what was consumed.
    job : str
        The generation's key on the workers.
    seed, shuffle
        The job's shuffling (each block's rows are shuffled where it is queued).
    trainers : sequence of str
        Each trainer's worker address, by index.
    out_of_blocks : callable
        What happens to a trainer that has no block left to get, ``fn(granter, trainer)``: True
        when it is taken care of, False to send it the end marker now. :meth:`end_now` (a sync
        rank ends with the others) or :meth:`wait_idle` (an async trainer waits: a lost trainer's
        blocks may still come back to it). A function, not an engine's method, so a granter
        holds no reference back to its engine (an engine then goes with its last reference, and
        its blocks with it).
    """

    def __init__(self, *, client: Client, blocks: BlockSet, ledger: Ledger, job: str, seed: int,
                 shuffle: bool, trainers: Sequence[str],
                 out_of_blocks: Callable[[Granter, int], bool], ahead: int = 2,
                 most_ahead: int = 0) -> None:
        self.client, self.blocks, self.ledger, self.job = client, blocks, ledger, job
        self.seed, self.shuffle = seed, shuffle
        self.out_of_blocks = out_of_blocks
        self.addresses = list(trainers)
        self.feeds: list[tuple[int, Future]] = []  # (trainer, feed task) not yet released
        # A block's feed task -> (its assignment, its arguments), to send it again if Dask
        # cancels it (see refeed_cancelled).
        self.assigned: dict[str, tuple[Any, dict[str, Any]]] = {}
        self.direct_feeds: set[asyncio.Task[None]] = set()
        self.ended = [False] * len(self.addresses)
        self.idle = [False] * len(self.addresses)  # out of blocks, waiting for the job's end
        self.sequence = [0] * len(self.addresses)
        self.retired: set[int] = set()
        # Workers leaving with notice (the engine's set): out of the scheduler's reach, their
        # trainers are fed directly until the hand-over, so they reach their next report.
        self.leaving: set[str] = set()
        self.stopping = False
        # Persisted blocks are in memory already: more credit would only move them sooner.
        self.ahead, self.most_ahead = ahead, max(ahead, most_ahead) if blocks.streamed else ahead
        self.credit: dict[int, int] = {}  # trainer -> credit, where it grew past ``ahead``

    def live(self) -> list[int]:
        """Trainers not lost (retired)."""
        return [i for i in range(len(self.addresses)) if i not in self.retired]

    def add_trainer(self, address: str) -> int:
        """A trainer that joins on ``address``; its index."""
        self.addresses.append(address)
        self.ended.append(False)
        self.idle.append(False)
        self.sequence.append(0)
        return len(self.addresses) - 1

    def retire(self, index: int) -> list[Future]:
        """Forget trainer ``index``; its feed tasks still pending (to cancel). Idle survivors are
        granted again: the lost trainer's blocks went back to the ledger."""
        self.retired.add(index)
        stale = [f for t, f in self.feeds if t == index and f.status == "pending"]
        self.feeds = [(t, f) for t, f in self.feeds if t != index]
        for i in self.live():
            if self.idle[i]:
                self.idle[i] = False
                self.grant(i)
        return stale

    def pinned(self, fn: Any, *args: Any, address: str, key: str, **kwargs: Any) -> Future:
        """:func:`pin` in this granter's generation."""
        return pin(self.client, self.job, fn, *args, address=address, key=key, **kwargs)

    def end_now(self, trainer: int) -> bool:
        """An ``out_of_blocks``: ``trainer`` gets its end marker now."""
        return False

    def wait_idle(self, trainer: int) -> bool:
        """An ``out_of_blocks``: keep ``trainer`` waiting for the job's end instead of ending it."""
        self.idle[trainer] = True
        self.end_idle()
        return True

    def granted(self, trainer: int, *, starved: bool) -> None:
        """``trainer`` reported a block: grant the next, and one more when it was ``starved`` and
        its credit may still grow (see ``most_ahead``)."""
        self.grant(trainer)
        credit = self.credit.get(trainer, self.ahead)
        if starved and credit < self.most_ahead:
            self.credit[trainer] = credit + 1
            self.grant(trainer)

    def grant(self, trainer: int) -> None:
        """Hand ``trainer`` its next block, or the end marker once every epoch is handed out."""
        if self.ended[trainer] or trainer in self.retired or self.stopping:
            return
        a = self.ledger.next_for(trainer)
        if a is None and self.out_of_blocks(self, trainer):
            return
        self.idle[trainer] = False
        address = self.addresses[trainer]
        common = self._common(trainer)
        if address in self.leaving:
            self.ended[trainer] = a is None
            self._feed_leaving(address, a, common)
            return
        if a is None:
            self.ended[trainer] = True
            fut = self.pinned(feed_block, None, address=address, key=f"dt-end-{trainer}",
                              epoch=-1, block=-1, **common)
            self.assigned[str(fut.key)] = (None, common)
        elif a.local and not self.blocks.streamed and \
                self._feed_direct(trainer, address, a, common):
            return
        elif self.blocks.lost(a.block):
            self._rescatter_then_feed(trainer, address, a, common)
            return
        else:
            fut = self._feed_task(trainer, address, a, common)
        self.feeds.append((trainer, fut))

    def keep_idle_alive(self, now: float) -> None:
        """Idle trainers wait for the others' last blocks: a heartbeat keeps their feed wait alive."""
        for i in self.live():
            if self.idle[i]:
                self.feeds.append((i, self.pinned(
                    feed_block, None, address=self.addresses[i],
                    key=f"dt-beat-{i}-{int(now * 1000)}", job=self.job, trainer=i,
                    seed=0, shuffle=False, seq=-1, epoch=-1, block=-2)))

    def _common(self, trainer: int) -> dict[str, Any]:
        common = {"job": self.job, "trainer": trainer, "seed": self.seed,
                  "shuffle": self.shuffle, "seq": self.sequence[trainer]}
        self.sequence[trainer] += 1
        return common

    def _feed_task(self, trainer: int, address: str, a: Any, common: dict[str, Any]) -> Future:
        # The sequence number is in the key: a block fed again after a cancel gets a new one.
        fut = self.pinned(
            feed_block, self.blocks.block_input(a.block), address=address,
            key=f"dt-feed-{a.epoch}-{a.block}-{trainer}-{common['seq']}",
            retries=self.blocks.retries, epoch=a.epoch, block=a.block, skip=a.skip, **common)
        self.assigned[str(fut.key)] = (a, common)
        return fut

    def refeed_cancelled(self) -> int:
        """Send again the feed tasks Dask cancelled while their trainer lives; how many.

        A feed task of in-memory input depends on a scattered block; when the worker holding it
        dies before the block was copied, the scheduler cancels the task ("lost dependencies")
        and the trainer would wait for it until its timeout. The block is scattered again from
        the client and fed under the same sequence number, so the trainer reads it in order.
        """
        again, keep = 0, []
        for trainer, fut in self.feeds:
            key = str(fut.key)
            if fut.status == "cancelled" and key in self.assigned and not self.stopping \
                    and trainer not in self.retired:
                a, common = self.assigned.pop(key)
                self._rescatter_then_feed(trainer, self.addresses[trainer], a, common,
                                          again=True)
                again += 1
            else:
                keep.append((trainer, fut))
        self.feeds = keep
        return again

    def forget_done(self) -> None:
        """Drop the finished feed tasks (cancelled ones stay until :meth:`refeed_cancelled`)."""
        self.feeds = [(t, f) for t, f in self.feeds if f.status != "finished"]
        live = {str(f.key) for _, f in self.feeds}
        self.assigned = {k: v for k, v in self.assigned.items() if k in live}

    def _rescatter_then_feed(self, trainer: int, address: str, a: Any,
                             common: dict[str, Any], *, again: bool = False) -> None:
        """In-memory input whose worker was lost (Dask cannot recompute scattered data): send the
        block from the client again, then feed it by task (``again``: its feed task was
        cancelled; the block is sent only if it is still lost)."""

        async def send() -> None:
            if not again or self.blocks.lost(a.block):
                await self.blocks.rescatter(self.client, a.block)
            if not self.stopping:
                self._feed_task_later(trainer, address, a, common)

        task = asyncio.get_running_loop().create_task(send())
        self.direct_feeds.add(task)
        task.add_done_callback(self.direct_feeds.discard)

    def _feed_task_later(self, trainer: int, address: str, a: Any,
                         common: dict[str, Any]) -> None:
        """The feed task of a block whose first way (a direct call, a scatter) ended after an
        await: by then its worker may be leaving. A retiring worker's blocks are moved off it
        first (the direct call finds none), and the scheduler has dropped it: a task pinned
        there would wait forever, its rank with it, and the hand-over would time out."""
        if address in self.leaving:
            self._feed_leaving(address, a, common)
        else:
            self.feeds.append((trainer, self._feed_task(trainer, address, a, common)))

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
                self._feed_task_later(trainer, address, a, common)

        task = loop.create_task(send())
        self.direct_feeds.add(task)  # a reference, or the task could be collected mid-flight
        task.add_done_callback(self.direct_feeds.discard)
        return True

    def redirect(self, address: str) -> list[Future]:
        """``address`` is leaving: its trainers' feed tasks that have not run (the scheduler
        dropped the worker, and they would wait there forever) are sent again directly, under
        their sequence numbers; returns the tasks dropped. One that ran already is read once:
        the trainer takes each sequence number once."""
        stale, keep = [], []
        for trainer, fut in self.feeds:
            key = str(fut.key)
            if self.addresses[trainer] == address and fut.status == "pending" and \
                    key in self.assigned:
                a, common = self.assigned.pop(key)
                self._feed_leaving(address, a, common)
                stale.append(fut)
            else:
                keep.append((trainer, fut))
        self.feeds = keep
        return stale

    def _feed_leaving(self, address: str, a: Any, common: dict[str, Any]) -> None:
        """Queue a block (None: the end marker) on a leaving worker's trainer: the block is
        brought through the client (a streamed one is read there), then queued by a direct
        call. Rare and bounded: only between a worker's notice and its hand-over."""

        async def send() -> None:
            pair: Any = None
            where = {"epoch": -1, "block": -1}
            try:
                if a is not None:
                    source = self.blocks.block_input(a.block)
                    # The block's task may be cancelled (its generation ends): as a gone worker.
                    pair = await self.client.gather(source, asynchronous=True) \
                        if isinstance(source, Future) else source
                    where = {"epoch": a.epoch, "block": a.block, "skip": a.skip}
                await run_direct(self.client, feed_block, pair, address=address, **where,
                                 **common)
            except Exception:  # gone: the hand-over fails, and the loss is decided as any other
                pass

        task = asyncio.get_running_loop().create_task(send())
        self.direct_feeds.add(task)
        task.add_done_callback(self.direct_feeds.discard)

    def end_idle(self) -> None:
        """Send end markers to idle trainers once every block handed out has been consumed."""
        live = self.live()
        if not all(self.idle[i] for i in live) or not self.ledger.all_reported():
            return
        for i in live:
            self.idle[i] = False
            self.ended[i] = True
            fut = self.pinned(feed_block, None, address=self.addresses[i],
                              key=f"dt-end-{i}", epoch=-1, block=-1, **self._common(i))
            self.feeds.append((i, fut))
