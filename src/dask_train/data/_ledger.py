"""The data ledger: which block each trainer reads, epoch by epoch, each sample exactly once.

Pure bookkeeping over plain records, tested without a cluster. The controller asks it for a
trainer's next block whenever that trainer has a free slot in its bounded queue, and records each
block the trainer reports as consumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class Block:
    """One block of rows of the training data, as persisted on the cluster.

    ``holders`` are the Dask workers that hold it in memory.
    """

    index: int
    start: int
    rows: int
    holders: tuple[str, ...] = ()


@dataclass(frozen=True)
class Assignment:
    """A block handed to a trainer for one epoch; ``local`` is False when it had to move."""

    epoch: int
    block: int
    trainer: int
    rows: int
    local: bool


@dataclass
class LedgerEntry:
    """What happened to one (epoch, block): who read it and how many rows they consumed."""

    epoch: int
    block: int
    trainer: int
    rows: int
    local: bool
    consumed: int = 0
    done: bool = False


@dataclass
class Ledger:
    """Assigns blocks to trainers, local blocks first, and proves exactly-once consumption.

    Parameters
    ----------
    blocks : sequence of Block
    trainers : sequence of str
        The worker address of each trainer, by trainer index.
    epochs : int
        Epochs to feed; after the last one :meth:`next_for` returns None.
    shuffle : bool
        Shuffle the block order of each epoch (seeded by ``seed`` and the epoch).
    seed : int

    Examples
    --------
    >>> blocks = [Block(0, 0, 10, ("a",)), Block(1, 10, 10, ("b",))]
    >>> ledger = Ledger(blocks, ["a", "b"], epochs=1, shuffle=False, seed=0)
    >>> ledger.next_for(1)
    Assignment(epoch=0, block=1, trainer=1, rows=10, local=True)
    """

    blocks: Sequence[Block]
    trainers: Sequence[str]
    epochs: int
    shuffle: bool = True
    seed: int = 0
    epoch: int = 0
    entries: dict[tuple[int, int], LedgerEntry] = field(default_factory=dict)
    _pending: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._by_index = {b.index: b for b in self.blocks}
        self.rows_per_epoch = sum(b.rows for b in self.blocks)
        self._plan_epoch(self.epoch)

    def _plan_epoch(self, epoch: int) -> None:
        """Split the epoch's blocks over trainers: each block to the least-loaded local trainer."""
        order = [b.index for b in self.blocks]
        if self.shuffle:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, 0xB10C]))
            order = [order[i] for i in rng.permutation(len(order))]
        self._pending = [[] for _ in self.trainers]
        load = [0] * len(self.trainers)
        for index in order:
            block = self._by_index[index]
            local = [t for t, addr in enumerate(self.trainers) if addr in block.holders]
            candidates = local or list(range(len(self.trainers)))
            t = min(candidates, key=lambda c: (load[c], c))
            self._pending[t].append(index)
            load[t] += block.rows

    def next_for(self, trainer: int) -> Assignment | None:
        """The next block for ``trainer``, or None when every epoch has been handed out.

        A trainer reads its own (local) blocks first; only when it has none left does it take one
        from the trainer with the most rows still pending, so a block moves between workers only
        when a trainer would otherwise idle.
        """
        while True:
            if self._pending[trainer]:
                index = self._pending[trainer].pop(0)
                break
            donor = self._richest()
            if donor is not None:
                # Take from the end of the donor's list: the block it would read last.
                index = self._pending[donor].pop()
                break
            if self.epoch + 1 >= self.epochs:
                return None
            self.epoch += 1
            self._plan_epoch(self.epoch)
        block = self._by_index[index]
        local = self.trainers[trainer] in block.holders
        key = (self.epoch, index)
        if key in self.entries:
            raise RuntimeError(f"block {index} of epoch {self.epoch} was assigned twice")
        self.entries[key] = LedgerEntry(self.epoch, index, trainer, block.rows, local)
        return Assignment(self.epoch, index, trainer, block.rows, local)

    def _richest(self) -> int | None:
        rows = [sum(self._by_index[i].rows for i in p) for p in self._pending]
        best = max(range(len(rows)), key=lambda t: rows[t], default=None)
        return best if best is not None and rows[best] > 0 else None

    def consumed(self, *, epoch: int, block: int, trainer: int, rows: int, done: bool) -> None:
        """Record that ``trainer`` consumed ``rows`` rows of ``block`` in ``epoch``."""
        entry = self.entries.get((epoch, block))
        if entry is None or entry.trainer != trainer:
            raise RuntimeError(
                f"trainer {trainer} reported block {block} of epoch {epoch}, "
                "which was not assigned to it"
            )
        if entry.done:
            raise RuntimeError(f"block {block} of epoch {epoch} was reported consumed twice")
        entry.consumed = rows
        entry.done = done

    def epoch_complete(self, epoch: int) -> bool:
        """True when every block of ``epoch`` has been consumed in full."""
        done = [e for (ep, _), e in self.entries.items() if ep == epoch and e.done]
        return len(done) == len(self.blocks) and all(e.consumed == e.rows for e in done)

    def all_reported(self) -> bool:
        """True when every block handed out has been reported back (consumed or not)."""
        return all(e.done or e.consumed for e in self.entries.values())

    @property
    def epochs_completed(self) -> int:
        """Number of leading epochs consumed in full."""
        n = 0
        while n < self.epochs and self.epoch_complete(n):
            n += 1
        return n

    def records(self) -> list[dict[str, object]]:
        """One plain record per (epoch, block) handed out, in assignment order."""
        return [asdict(e) for e in self.entries.values()]
