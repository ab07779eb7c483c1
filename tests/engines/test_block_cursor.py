"""BlockCursor: the one reader of a trainer role's blocks (sync ranks, dt.run, async-ps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np

from dask_train.data._feed import FeedItem
from dask_train.engines.harness.role import BlockCursor, TrainerRole


def _item(seq: int, epoch: int, block: int, rows: int, skip: int = 0) -> FeedItem:
    return FeedItem(seq=seq, epoch=epoch, block=block, x=np.zeros((rows, 2)), y=np.zeros(rows),
                    seed=0, shuffle=False, skip=skip)


_END = FeedItem(seq=-1, epoch=0, block=-1, x=None, y=None, seed=0, shuffle=False)


class _Reader:
    def __init__(self, items: list[FeedItem | None]) -> None:
        self.items, self.reads, self.wait_s = list(items), 0, 0.0

    def next(self) -> FeedItem | None:
        self.reads += 1
        return self.items.pop(0)


class _Role:
    """What the cursor uses of a TrainerRole: its feed and its block reports."""

    def __init__(self, items: list[FeedItem | None]) -> None:
        self.reader = _Reader(items)
        self.on_idle: Callable[[], None] | None = None
        self.reports: list[tuple[int, int, int, bool, int]] = []

    def feed(self, on_idle: Callable[[], None] | None = None) -> Any:
        self.on_idle = on_idle
        return self.reader

    def block(self, epoch: int, block: int, *, rows: int, done: bool, steps: int) -> None:
        self.reports.append((epoch, block, rows, done, steps))


def _cursor(items: list[FeedItem | None], on_idle: Callable[[], None] | None = None
            ) -> tuple[BlockCursor, _Role]:
    role = _Role(items)
    return BlockCursor(cast(TrainerRole, role), on_idle=on_idle), role


def test_blocks_are_reported_once_left_with_the_rows_taken_and_whether_done() -> None:
    cursor, role = _cursor([_item(0, 0, 3, rows=5), _item(1, 0, 7, rows=4), _END])
    assert cursor.position() is None
    item = cursor.next_block()
    assert item is not None and item.block == 3
    cursor.take(2)
    cursor.take(3)
    assert cursor.position() == [0, 3, 5]
    cursor.close_block(steps=2)
    assert cursor.position() is None
    assert cursor.next_block() is not None
    cursor.take(2)  # a stop in the middle of the block: reported in part
    cursor.close_block(steps=3)
    assert role.reports == [(0, 3, 5, True, 2), (0, 7, 2, False, 3)]
    assert (cursor.samples, cursor.batches) == (7, 3)
    cursor.close_block(steps=9)  # between blocks: nothing to report
    assert len(role.reports) == 2


def test_rows_a_resume_skipped_count_as_consumed_but_not_as_taken() -> None:
    cursor, role = _cursor([_item(0, 1, 2, rows=6, skip=4), _END])
    assert cursor.next_block() is not None
    assert cursor.position() == [1, 2, 4]
    cursor.take(2)
    cursor.close_block(steps=1)
    assert role.reports == [(1, 2, 2, True, 1)]
    assert cursor.samples == 2


def test_the_end_marker_or_a_stop_ends_the_feed_for_good() -> None:
    for last in (_END, None):  # None: the job was stopped
        cursor, role = _cursor([last])
        assert cursor.next_block() is None and cursor.ended
        assert cursor.next_block() is None
        assert role.reader.reads == 1, "an ended feed is not read again"


def test_a_later_epoch_waits_for_its_turn() -> None:
    cursor, role = _cursor([_item(0, 0, 1, rows=2), _item(1, 1, 0, rows=2), _END])
    assert cursor.next_block(0) is not None
    cursor.take(2)
    cursor.close_block(steps=1)
    assert cursor.next_block(0) is None and not cursor.ended  # epoch 1's block, read early
    assert cursor.next_block(0) is None and role.reader.reads == 2
    item = cursor.next_block(1)
    assert item is not None and (item.epoch, item.block) == (1, 0)
    assert cursor.next_block(1) is None and cursor.ended


def test_the_idle_hook_goes_to_the_feed() -> None:
    def idle() -> None:
        pass

    _, role = _cursor([_END], on_idle=idle)
    assert role.on_idle is idle
