"""The data ledger: which block each trainer reads, epoch by epoch, each sample exactly once.

Pure bookkeeping over plain records, tested without a cluster. The controller asks it for a
trainer's next block whenever that trainer has a free slot in its bounded queue, and records each
block the trainer reports as consumed. When a trainer's worker dies, :meth:`Ledger.retire` hands
the rows it had not applied to the survivors; :meth:`Ledger.state` and :meth:`Ledger.from_state`
carry the ledger through a checkpoint so that a resumed run reads exactly the rows that remain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from dask_train.errors import InvalidInput

STATE_VERSION = 1


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
    """A block handed to a trainer for one epoch; ``local`` is False when it had to move.

    ``skip`` rows of the block, the first ones in the block's deterministic row order, were already
    applied to the model (by a trainer that was lost, or before a checkpoint): the trainer skips them.
    """

    epoch: int
    block: int
    trainer: int
    rows: int
    local: bool
    skip: int = 0


@dataclass
class LedgerEntry:
    """What happened to one (epoch, block): who read it and how many rows they consumed.

    ``consumed`` counts the block's rows applied in total, ``skip`` included, once reported;
    ``moved_from`` is the trainer the block was taken from after that trainer was lost.
    """

    epoch: int
    block: int
    trainer: int
    rows: int
    local: bool
    consumed: int = 0
    done: bool = False
    skip: int = 0
    moved_from: int | None = None


_ENTRY_FIELDS = [f.name for f in fields(LedgerEntry)]


@dataclass(frozen=True)
class _Requeued:
    """A block to read again, in part: the rows after ``skip``."""

    epoch: int
    block: int
    skip: int
    moved_from: int | None


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
    Assignment(epoch=0, block=1, trainer=1, rows=10, local=True, skip=0)
    """

    blocks: Sequence[Block]
    trainers: Sequence[str]
    epochs: int
    shuffle: bool = True
    seed: int = 0
    epoch: int = 0
    entries: dict[tuple[int, int], LedgerEntry] = field(default_factory=dict)
    _pending: list[list[int]] = field(default_factory=list)
    # Per trainer, blocks to read before its pending ones: taken from a lost trainer, or not
    # finished before a checkpoint. They may belong to an epoch before ``epoch``.
    _requeue: list[list[_Requeued]] = field(default_factory=list, init=False, repr=False)
    _retired: set[int] = field(default_factory=set, init=False, repr=False)
    # Trainers told that the feed ended (next_for returned None): given work only as a last resort.
    _finished: set[int] = field(default_factory=set, init=False, repr=False)
    # Pending blocks of the current epoch that came from a lost trainer's list, by (epoch, block).
    _moved: dict[tuple[int, int], int] = field(default_factory=dict, init=False, repr=False)
    _complete: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.trainers = list(self.trainers)
        self._by_index = {b.index: b for b in self.blocks}
        self.rows_per_epoch = sum(b.rows for b in self.blocks)
        self._requeue = [[] for _ in self.trainers]
        self._plan_epoch(self.epoch)

    # -- planning ---------------------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> list[int]:
        order = [b.index for b in self.blocks]
        if self.shuffle:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, 0xB10C]))
            order = [order[i] for i in rng.permutation(len(order))]
        return order

    def _live(self) -> list[int]:
        return [t for t in range(len(self.trainers)) if t not in self._retired]

    def _plan_epoch(self, epoch: int) -> None:
        """Split the epoch's blocks over trainers: each block to the least-loaded local trainer."""
        self._pending = self._split(self._epoch_order(epoch))

    def _split(self, order: Sequence[int]) -> list[list[int]]:
        pending: list[list[int]] = [[] for _ in self.trainers]
        live = self._live()
        load = [0] * len(self.trainers)
        for index in order:
            block = self._by_index[index]
            local = [t for t in live if self.trainers[t] in block.holders]
            t = min(local or live, key=lambda c: (load[c], c))
            pending[t].append(index)
            load[t] += block.rows
        return pending

    # -- handing out ------------------------------------------------------------------------------
    def next_for(self, trainer: int) -> Assignment | None:
        """The next block for ``trainer``, or None when every epoch has been handed out.

        A trainer reads the blocks requeued to it first, then its own (local) blocks; only when it
        has none left does it take one from the trainer with the most rows still queued (requeued
        rows first, being older work), so a block moves between workers only when a trainer would
        otherwise idle.

        Raises
        ------
        RuntimeError
            If ``trainer`` was retired.
        """
        if trainer in self._retired:
            raise RuntimeError(f"trainer {trainer} was retired (its worker was lost): it gets no blocks")
        while True:
            item = self._take(trainer)
            if item is not None:
                break
            if self.epoch + 1 >= self.epochs:
                self._finished.add(trainer)
                return None
            self.epoch += 1
            self._plan_epoch(self.epoch)
        self._finished.discard(trainer)
        block = self._by_index[item.block]
        local = self.trainers[trainer] in block.holders
        key = (item.epoch, item.block)
        if key in self.entries:
            raise RuntimeError(f"block {item.block} of epoch {item.epoch} was assigned twice")
        self.entries[key] = LedgerEntry(
            item.epoch, item.block, trainer, block.rows, local, skip=item.skip, moved_from=item.moved_from
        )
        return Assignment(item.epoch, item.block, trainer, block.rows, local, item.skip)

    def _take(self, trainer: int) -> _Requeued | None:
        """The next item of the current lists for ``trainer``, or None when they are all empty."""
        if self._requeue[trainer]:
            return self._requeue[trainer].pop(0)
        if self._pending[trainer]:
            return self._pending_item(self._pending[trainer].pop(0))
        donor = self._richest(self._requeue_rows())
        if donor is not None:
            # Take from the end of the donor's list: the block it would read last.
            return self._requeue[donor].pop()
        donor = self._richest(self._pending_rows())
        if donor is not None:
            return self._pending_item(self._pending[donor].pop())
        return None

    def _pending_item(self, index: int) -> _Requeued:
        return _Requeued(self.epoch, index, 0, self._moved.pop((self.epoch, index), None))

    def _pending_rows(self) -> list[int]:
        return [sum(self._by_index[i].rows for i in p) for p in self._pending]

    def _requeue_rows(self) -> list[int]:
        return [sum(self._by_index[r.block].rows - r.skip for r in q) for q in self._requeue]

    @staticmethod
    def _richest(rows: Sequence[int]) -> int | None:
        best = max(range(len(rows)), key=lambda t: rows[t], default=None)
        return best if best is not None and rows[best] > 0 else None

    # -- reports ----------------------------------------------------------------------------------
    def consumed(self, *, epoch: int, block: int, trainer: int, rows: int, done: bool) -> None:
        """Record that ``trainer`` consumed ``rows`` rows of ``block`` in ``epoch``.

        ``rows`` counts the rows read in this assignment, after its ``skip``. A report from a
        retired trainer is ignored: its blocks were handed on with the rows the servers had applied.
        """
        if trainer in self._retired:
            return
        entry = self.entries.get((epoch, block))
        if entry is None or entry.trainer != trainer:
            raise RuntimeError(
                f"trainer {trainer} reported block {block} of epoch {epoch}, "
                "which was not assigned to it"
            )
        if entry.done:
            raise RuntimeError(f"block {block} of epoch {epoch} was reported consumed twice")
        if rows < 0 or entry.skip + rows > entry.rows:
            raise RuntimeError(
                f"trainer {trainer} reported {rows} rows of block {block} of epoch {epoch} after "
                f"skipping {entry.skip}, but the block has {entry.rows}"
            )
        entry.consumed = entry.skip + rows
        entry.done = done

    def epoch_complete(self, epoch: int) -> bool:
        """True when every block of ``epoch`` has been consumed in full."""
        return all((e := self.entries.get((epoch, b.index))) is not None and e.done
                   and e.consumed == e.rows for b in self.blocks)

    def all_reported(self) -> bool:
        """True when every block handed out has been reported back (consumed or not)."""
        return all(e.done or e.consumed for e in self.entries.values())

    @property
    def epochs_completed(self) -> int:
        """Number of leading epochs consumed in full."""
        # Asked at every block's report: start from the epochs known complete (a done entry is
        # never undone), not rescan every epoch before the current one each time.
        n = self._complete
        while n < self.epochs and self.epoch_complete(n):
            n += 1
        self._complete = n
        return n

    def records(self) -> list[dict[str, object]]:
        """One plain record per (epoch, block) handed out, in assignment order; ``consumed``
        counts the rows applied so far.

        A block partly read by a lost trainer, or by the generation before a resume, waits to
        be read again from ``skip``, the rows already applied: until its new reader reports it,
        those rows count as consumed (a record of the trainer it waits for, after the others,
        while it is not handed out again). Without them, a job stopped in between showed fewer
        rows than its parameters had seen.
        """
        records = [{**asdict(e), "consumed": max(e.consumed, e.skip)}
                   for e in self.entries.values()]
        for trainer, queue in enumerate(self._requeue):
            for r in queue:
                if r.skip and (r.epoch, r.block) not in self.entries:
                    block = self._by_index[r.block]
                    records.append(asdict(LedgerEntry(
                        r.epoch, r.block, trainer, block.rows,
                        self.trainers[trainer] in block.holders, consumed=r.skip, skip=r.skip,
                        moved_from=r.moved_from)))
        return records

    # -- losing and gaining trainers -------------------------------------------------------------
    @property
    def retired(self) -> frozenset[int]:
        """Indexes of the trainers retired after their worker was lost."""
        return frozenset(self._retired)

    def retire(
        self, trainer: int, applied: Mapping[tuple[int, int], int] | None = None
    ) -> list[tuple[int, int]]:
        """Hand a lost trainer's unfinished blocks to the surviving trainers.

        Every block assigned to it and not done is requeued with ``skip`` = the rows the parameter
        servers saw applied from it (``applied``, else the rows it reported); a block already fully
        applied is marked done instead. Its requeued and pending blocks move too. Each goes to a
        survivor holding the block, else to the one with the fewest rows queued. Retiring a trainer
        twice does nothing.

        Parameters
        ----------
        trainer : int
        applied : mapping of (epoch, block) to int, optional
            Rows of each block applied to the parameters, ``skip`` included.

        Returns
        -------
        list of (epoch, block)
            The blocks moved, assigned ones first.

        Raises
        ------
        RuntimeError
            If no trainer would remain.

        Examples
        --------
        >>> ledger = Ledger([Block(0, 0, 10, ("a",))], ["a", "b"], epochs=1, shuffle=False)
        >>> ledger.next_for(0).block
        0
        >>> ledger.retire(0, applied={(0, 0): 4})
        [(0, 0)]
        >>> ledger.next_for(1)
        Assignment(epoch=0, block=0, trainer=1, rows=10, local=False, skip=4)
        """
        if trainer in self._retired:
            return []
        survivors = [t for t in self._live() if t != trainer]
        if not survivors:
            raise RuntimeError(f"retiring trainer {trainer} would leave no trainer to read the data")
        applied = applied or {}
        items: list[_Requeued] = []
        for key, entry in list(self.entries.items()):
            if entry.trainer != trainer or entry.done:
                continue
            skip = min(entry.rows, applied.get(key, max(entry.consumed, entry.skip)))
            if skip >= entry.rows:
                # Every row reached the parameters; only the report was lost with the worker.
                entry.consumed, entry.done = entry.rows, True
                continue
            del self.entries[key]
            items.append(_Requeued(entry.epoch, entry.block, skip, trainer))
        items += [_Requeued(r.epoch, r.block, r.skip, trainer) for r in self._requeue[trainer]]
        pending = self._pending[trainer]
        self._retired.add(trainer)
        self._requeue[trainer], self._pending[trainer] = [], []
        self._spread_requeue(items, targets=survivors)
        self._spread_pending(pending, targets=survivors, moved_from=trainer)
        return [(r.epoch, r.block) for r in items] + [(self.epoch, i) for i in pending]

    def _load(self, t: int) -> int:
        return sum(self._by_index[i].rows for i in self._pending[t]) + sum(
            self._by_index[r.block].rows - r.skip for r in self._requeue[t]
        )

    def _target(self, index: int, targets: Sequence[int], load: Mapping[int, int]) -> int:
        # Trainers still reading first: one already told the feed ended gets work only when no
        # other can take it (its controller must then start it again).
        active = [t for t in targets if t not in self._finished] or list(targets)
        holders = self._by_index[index].holders
        local = [t for t in active if self.trainers[t] in holders]
        return min(local or active, key=lambda c: (load[c], c))

    def _spread_requeue(self, items: Sequence[_Requeued], *, targets: Sequence[int]) -> None:
        load = {t: self._load(t) for t in targets}
        for item in items:
            t = self._target(item.block, targets, load)
            self._requeue[t].append(item)
            load[t] += self._by_index[item.block].rows - item.skip

    def _spread_pending(self, indices: Sequence[int], *, targets: Sequence[int], moved_from: int) -> None:
        load = {t: self._load(t) for t in targets}
        for index in indices:
            t = self._target(index, targets, load)
            self._pending[t].append(index)
            self._moved[(self.epoch, index)] = moved_from
            load[t] += self._by_index[index].rows

    def add_trainer(self, address: str) -> int:
        """Add a trainer on a worker that joined; it is planned into the next epoch on.

        The current epoch's lists are left alone, so until the next epoch it only takes blocks
        others would read last, as any idle trainer does.

        Examples
        --------
        >>> ledger = Ledger([Block(0, 0, 10, ("a",))], ["a"], epochs=2, shuffle=False)
        >>> ledger.add_trainer("b")
        1
        """
        self.trainers = [*self.trainers, address]
        self._pending.append([])
        self._requeue.append([])
        return len(self.trainers) - 1

    # -- checkpoints ------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The ledger as plain JSON-serialisable values, for a checkpoint's manifest.

        Examples
        --------
        >>> import json
        >>> ledger = Ledger([Block(0, 0, 10, ("a",))], ["a"], epochs=2, shuffle=True, seed=3)
        >>> _ = ledger.next_for(0)
        >>> state = json.loads(json.dumps(ledger.state()))
        >>> again = Ledger.from_state([Block(0, 0, 10, ("a",))], ["a"], epochs=2, shuffle=True,
        ...                           seed=3, state=state)
        >>> again.next_for(0)
        Assignment(epoch=0, block=0, trainer=0, rows=10, local=True, skip=0)
        """
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "trainers": list(self.trainers),
            "blocks": [[b.index, b.rows] for b in self.blocks],
            # Rows, not dicts: a long run holds one entry per block and epoch.
            "entry_fields": _ENTRY_FIELDS,
            "entries": [[getattr(e, name) for name in _ENTRY_FIELDS] for e in self.entries.values()],
            "pending": [list(p) for p in self._pending],
            "requeue": [[[r.epoch, r.block, r.skip, r.moved_from] for r in q] for q in self._requeue],
            "retired": sorted(self._retired),
            "moved": [[e, b, t] for (e, b), t in self._moved.items()],
        }

    @classmethod
    def from_state(
        cls,
        blocks: Sequence[Block],
        trainers: Sequence[str],
        *,
        epochs: int,
        shuffle: bool,
        seed: int,
        state: Mapping[str, Any],
    ) -> Ledger:
        """Restore a ledger from :meth:`state`, for trainers that may be other workers, or fewer.

        Entries done are kept. Entries not done are requeued with ``skip`` = their consumed rows,
        in their original assignment order, each to the trainer of the same index when it exists,
        else spread as in :meth:`retire`; that order is what makes a resumed single-trainer run read
        the same rows as an uninterrupted one. The current epoch's pending lists are kept when the
        number of trainers is unchanged, else split again over the new trainers.

        Raises
        ------
        InvalidInput
            If the state is from another version or another set of blocks.
        """
        if state.get("version") != STATE_VERSION:
            raise InvalidInput(
                [f"ledger state version {state.get('version')!r} is not {STATE_VERSION}: the checkpoint "
                 "was written by another version of dask-train; resume with that version."]
            )
        if [list(b) for b in state["blocks"]] != [[b.index, b.rows] for b in blocks]:
            written = written_rows(state)
            raise InvalidInput(
                [f"the checkpoint's data ledger was written for {len(written)} data blocks of "
                 f"{sum(written)} rows in all, the data has {len(blocks)} of "
                 f"{sum(b.rows for b in blocks)} (rows a block differ): resume with the same "
                 "data, chunked the same way."]
            )
        ledger = cls(blocks, trainers, epochs=epochs, shuffle=shuffle, seed=seed, epoch=int(state["epoch"]))
        same_count = len(state["pending"]) == len(ledger.trainers)
        targets = list(range(len(ledger.trainers)))
        unfinished: list[tuple[int, _Requeued]] = []
        names = list(state["entry_fields"])
        for row in state["entries"]:
            entry = LedgerEntry(**{k: v for k, v in zip(names, row) if k in _ENTRY_FIELDS})
            skip = min(entry.rows, max(entry.consumed, entry.skip))
            if not entry.done and skip >= entry.rows:
                # Every row was applied before the checkpoint; only the "done" report was missing.
                entry.consumed, entry.done = entry.rows, True
            if entry.done:
                ledger.entries[(entry.epoch, entry.block)] = entry
            else:
                item = _Requeued(entry.epoch, entry.block, skip, entry.moved_from)
                unfinished.append((entry.trainer, item))
        for t, queue in enumerate(state["requeue"]):
            unfinished += [(t, _Requeued(int(e), int(b), int(s), m)) for e, b, s, m in queue]
        # A run resumed with fewer epochs than it had reached reads nothing beyond them.
        unfinished = [(t, item) for t, item in unfinished if item.epoch < epochs]
        for t, item in unfinished:
            if t < len(ledger.trainers):
                ledger._requeue[t].append(item)
            else:
                ledger._spread_requeue([item], targets=targets)
        if ledger.epoch >= epochs:
            ledger._pending = [[] for _ in ledger.trainers]
        elif same_count:
            ledger._pending = [[int(i) for i in p] for p in state["pending"]]
        else:
            left = {int(i) for p in state["pending"] for i in p}
            ledger._pending = ledger._split([i for i in ledger._epoch_order(ledger.epoch) if i in left])
        ledger._moved = {(int(e), int(b)): int(t) for e, b, t in state["moved"]}
        return ledger


def written_rows(state: Mapping[str, Any]) -> list[int]:
    """The rows of each block, in order, that a ledger :meth:`~Ledger.state` was written for:
    a job resumed from it cuts the same data into these blocks (whatever cut the job that wrote
    it chose, e.g. ``dt.run``'s rechunking for its number of ranks), so the ledger's entries
    name the same rows again.

    Examples
    --------
    >>> ledger = Ledger([Block(0, 0, 10), Block(1, 10, 6)], ["a"], epochs=1, shuffle=False)
    >>> written_rows(ledger.state())
    [10, 6]
    """
    return [int(rows) for _, rows in sorted((int(i), int(r)) for i, r in state["blocks"])]


def patch_positions(ledger_state: dict[str, Any], positions: Mapping[int, Any]) -> dict[str, Any]:
    """The ledger state at the trainers' ``positions``: each one's partial block counted as
    consumed so far, and the blocks it was given before that one as consumed in full.

    ``positions`` maps trainer -> [epoch, block, rows] (rows applied, skip included). A trainer
    reads its blocks in the order they were given to it, which is the order of the entries (a
    block given again is entered again, at the end), so a block before its position was read
    to the end, even when its report has not reached the ledger: the survivors of a killed sync
    rank give their positions straight from memory, while their last reports, and the killed
    rank's, may still be on their way or lost with it. Counted unread, such a block was trained
    again (a chaos run: 1,000 samples applied twice).
    """
    where = {(int(p[0]), int(p[1])): int(p[2]) for p in positions.values() if p is not None}
    at = {(int(p[0]), int(p[1])): int(t) for t, p in positions.items() if p is not None}
    fields = list(ledger_state["entry_fields"])
    epoch, block, trainer = fields.index("epoch"), fields.index("block"), fields.index("trainer")
    rows, consumed, done = fields.index("rows"), fields.index("consumed"), fields.index("done")
    # Each trainer's entries before the one it is in: read to the end.
    seen: dict[int, list[list[Any]]] = {}
    for entry in ledger_state["entries"]:
        key = (int(entry[epoch]), int(entry[block]))
        owner = int(entry[trainer])
        if key in where and at[key] == owner:
            for earlier in seen.pop(owner, []):
                earlier[consumed], earlier[done] = earlier[rows], True
        elif not entry[done]:
            seen.setdefault(owner, []).append(entry)
        if key in where and not entry[done]:
            entry[consumed] = where[key]
    return ledger_state
