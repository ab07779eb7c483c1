"""Feeding, framework-free: blocks in a trainer's queue, read in assignment order, cut into
shuffled minibatches of numpy arrays. An engine converts batches to its framework's tensors; the
worker side that fills the queues is in :mod:`dask_train.runtime._enqueue`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dask_train.errors import TrainingTimeout

#: A trainer that waited longer than this for a block, after its first, was starved: a block
#: more in its queue would have been there in time (see :meth:`FeedReader.take_starved`).
STARVED_S = 0.002


@dataclass
class FeedItem:
    """A block in a trainer's queue; ``x is None`` marks the end of the feed."""

    seq: int
    epoch: int
    block: int
    x: np.ndarray | None
    y: np.ndarray | None
    seed: int
    shuffle: bool
    # Rows of the block already applied to the model before a resume or a trainer's loss: they
    # come first in the block's row order and are not read again.
    skip: int = 0
    w: np.ndarray | None = None  # sample weights, when the job has them
    read_s: float = 0.0  # seconds its feed task spent reading it (a streamed block)

    @property
    def rows(self) -> int:
        """Rows in the block."""
        return 0 if self.x is None else len(self.x)

    @property
    def nbytes(self) -> int:
        """Bytes the block holds (inputs, targets and weights)."""
        return sum(int(a.nbytes) for a in (self.x, self.y, self.w) if a is not None)


def block_order(*, rows: int, seed: int, epoch: int, block: int, shuffle: bool) -> np.ndarray:
    """The row order of one block in one epoch: a seeded permutation, or ``arange`` unshuffled.

    Examples
    --------
    >>> block_order(rows=4, seed=0, epoch=0, block=0, shuffle=False)
    array([0, 1, 2, 3])
    """
    if not shuffle:
        return np.arange(rows)
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, block]))
    return rng.permutation(rows)


def batches(item: FeedItem, batch_size: int
            ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """Minibatches ``(x, y, weights or None)`` of one block in its epoch's order; the last one
    may be smaller.

    Batches never span two blocks, so a block's consumption is exactly its rows, which keeps the
    ledger simple and a resumed run's batches identical.
    """
    assert item.x is not None and item.y is not None
    order = block_order(
        rows=item.rows, seed=item.seed, epoch=item.epoch, block=item.block, shuffle=item.shuffle
    )
    # A skip is a whole number of batches taken before an interruption, so the batches that follow
    # are the ones an uninterrupted run would read.
    for i in range(item.skip, item.rows, batch_size):
        idx = order[i : i + batch_size]
        w = item.w
        if item.shuffle:
            # A gather is a copy: a fresh contiguous batch.
            xb, yb, wb = item.x[idx], item.y[idx], None if w is None else w[idx]
        else:
            xb, yb = item.x[i : i + batch_size], item.y[i : i + batch_size]
            wb = None if w is None else w[i : i + batch_size]
        yield (np.ascontiguousarray(xb), np.ascontiguousarray(yb),
               None if wb is None else np.ascontiguousarray(wb))


class FeedReader:
    """Reads a trainer's queue in the order the controller assigned the blocks.

    Feed tasks may finish out of order (a local block is ready before a moved one arrives), so
    items carry a sequence number and early arrivals wait here. Reading in assignment order makes
    a run's batches a function of the seed alone, which exact resume and the tests rely on.
    """

    def __init__(self, feed: queue.Queue[FeedItem], stop: threading.Event, *, timeout: float,
                 role: str, on_idle: Callable[[], None] | None = None) -> None:
        self.feed = feed
        self.stop = stop
        self.timeout = timeout
        self.role = role
        # Called between polls while waiting: a trainer idle for data must still take part in a
        # checkpoint pause.
        self.on_idle = on_idle
        self.expected = 0
        self.early: dict[int, FeedItem] = {}
        self.read_s: dict[int, float] = {}  # epoch -> seconds reading this trainer's blocks
        self.read_bytes = 0
        self.held = 0  # bytes of blocks held for this trainer at the last block's start
        self.held_max = 0  # the most bytes of blocks held for this trainer at a block's start
        self.held_blocks_max = 0  # and the most blocks
        self.starved = False  # waited for a block since take_starved() was last asked
        self.block_bytes = 0  # bytes of the last block read
        self.wait_s = 0.0  # seconds next() waited: a trainer's or rank's feed_wait_s

    def take_starved(self) -> bool:
        """Whether the trainer waited for a block (not its first) since the last call: its
        queue ran dry, so blocks arrive later than it trains on them."""
        starved, self.starved = self.starved, False
        return starved

    def next(self) -> FeedItem | None:
        """The next block; None when the job was stopped. Raises after ``timeout`` seconds."""
        started = time.perf_counter()
        try:
            return self._next()
        finally:
            self.wait_s += time.perf_counter() - started

    def _next(self) -> FeedItem | None:
        asked = time.monotonic()
        deadline = asked + self.timeout
        while not self.stop.is_set():
            if self.expected in self.early:
                self.expected += 1
                item = self._account(self.early.pop(self.expected - 1))
                if item.x is not None and self.expected > 1 and \
                        time.monotonic() - asked > STARVED_S:
                    self.starved = True
                return item
            try:
                # Short polls so a stop signal is seen within 0.1 s even while waiting for data.
                item = self.feed.get(timeout=0.1)
                if item.block == -2:  # heartbeat: the controller is alive, more may come
                    deadline = time.monotonic() + self.timeout
                else:
                    self.early[item.seq] = item
            except queue.Empty:
                if self.on_idle is not None:
                    self.on_idle()
                if time.monotonic() > deadline:
                    raise TrainingTimeout(
                        f"{self.role} received no data for {self.timeout:g} s; raise timeout= if "
                        "blocks are slow to compute, or check the worker logs of the feed tasks"
                    ) from None
        return None

    def _account(self, item: FeedItem) -> FeedItem:
        """Count ``item``'s read time and the bytes held now: it, the early arrivals and the
        queue (the previous block is done with once the trainer asks for the next)."""
        if item.x is not None:
            self.read_s[item.epoch] = self.read_s.get(item.epoch, 0.0) + item.read_s
            self.read_bytes += item.nbytes
            self.block_bytes = item.nbytes
            with self.feed.mutex:  # the feed tasks put from other threads
                queued = [i.nbytes for i in self.feed.queue if i.x is not None]
            held = item.nbytes + sum(queued) + sum(i.nbytes for i in self.early.values())
            self.held, self.held_max = held, max(self.held_max, held)
            self.held_blocks_max = max(self.held_blocks_max, 1 + len(queued) + len(self.early))
        return item

    def stats(self) -> dict[str, Any]:
        """What this trainer read: seconds per epoch (``read_s_by_epoch``, summed over its
        blocks; reads overlap training when ``blocks_ahead`` >= 2), bytes read, and the most
        bytes and blocks held for it at once (``held_bytes_max``, ``held_blocks_max``)."""
        epochs = max(self.read_s, default=-1) + 1
        return {"read_s": round(sum(self.read_s.values()), 4),
                "read_s_by_epoch": [round(self.read_s.get(e, 0.0), 4) for e in range(epochs)],
                "read_bytes": int(self.read_bytes), "held_bytes_max": int(self.held_max),
                "held_blocks_max": int(self.held_blocks_max)}
