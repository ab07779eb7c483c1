"""The ledger hands out each block once per epoch, local blocks first; blocks move only to idle trainers."""

from __future__ import annotations

import pytest

from dask_train.data import Block, Ledger, block_order


def _blocks(holders: list[str], rows: int = 10) -> list[Block]:
    return [Block(i, i * rows, rows, (h,)) for i, h in enumerate(holders)]


def _drain(ledger: Ledger, trainers: int) -> list:
    """Round-robin the trainers, each reporting its block at once, until nothing is left."""
    out, active = [], set(range(trainers))
    while active:
        for t in sorted(active):
            a = ledger.next_for(t)
            if a is None:
                active.discard(t)
                continue
            ledger.consumed(epoch=a.epoch, block=a.block, trainer=t, rows=a.rows, done=True)
            out.append(a)
    return out


def test_each_block_once_per_epoch() -> None:
    ledger = Ledger(_blocks(["a", "b", "a", "b", "a"]), ["a", "b"], epochs=3, shuffle=True, seed=1)
    handed = _drain(ledger, 2)
    for epoch in range(3):
        blocks = sorted(a.block for a in handed if a.epoch == epoch)
        assert blocks == [0, 1, 2, 3, 4]
    assert ledger.epochs_completed == 3
    assert ledger.all_reported()


def test_local_blocks_first_and_moves_only_when_idle() -> None:
    # Trainer 1's worker holds one block, trainer 0's holds three: trainer 1 reads its own block,
    # then takes one of trainer 0's, so exactly one block moves.
    ledger = Ledger(_blocks(["a", "a", "a", "b"]), ["a", "b"], epochs=1, shuffle=False, seed=0)
    first = ledger.next_for(1)
    assert first is not None and first.block == 3 and first.local
    second = ledger.next_for(1)
    assert second is not None and not second.local
    rest = [ledger.next_for(0), ledger.next_for(0)]
    assert all(a is not None and a.local for a in rest)
    assert ledger.next_for(0) is None and ledger.next_for(1) is None


def test_two_trainers_on_one_worker_share_its_blocks() -> None:
    ledger = Ledger(_blocks(["a"] * 4), ["a", "a"], epochs=1, shuffle=False, seed=0)
    a0, a1 = ledger.next_for(0), ledger.next_for(1)
    assert a0 is not None and a1 is not None and a0.local and a1.local
    assert a0.block != a1.block


def test_double_report_is_refused() -> None:
    ledger = Ledger(_blocks(["a"]), ["a"], epochs=1, shuffle=False, seed=0)
    a = ledger.next_for(0)
    assert a is not None
    ledger.consumed(epoch=0, block=a.block, trainer=0, rows=10, done=True)
    with pytest.raises(RuntimeError, match="reported consumed twice"):
        ledger.consumed(epoch=0, block=a.block, trainer=0, rows=10, done=True)
    with pytest.raises(RuntimeError, match="not assigned to it"):
        ledger.consumed(epoch=0, block=a.block, trainer=1, rows=10, done=True)


def test_partial_consumption_does_not_complete_the_epoch() -> None:
    ledger = Ledger(_blocks(["a", "a"]), ["a"], epochs=1, shuffle=False, seed=0)
    a = ledger.next_for(0)
    b = ledger.next_for(0)
    assert a is not None and b is not None
    ledger.consumed(epoch=0, block=a.block, trainer=0, rows=10, done=True)
    ledger.consumed(epoch=0, block=b.block, trainer=0, rows=4, done=False)
    assert ledger.epochs_completed == 0
    records = ledger.records()
    assert [r["consumed"] for r in records] == [10, 4]


def test_shuffled_block_order_is_seeded_and_changes_per_epoch() -> None:
    def order(seed: int) -> list[list[int]]:
        ledger = Ledger(_blocks(["a"] * 8), ["a"], epochs=2, shuffle=True, seed=seed)
        handed = _drain(ledger, 1)
        return [[a.block for a in handed if a.epoch == e] for e in range(2)]

    assert order(3) == order(3)
    assert order(3) != order(4)
    assert order(3)[0] != order(3)[1]


def test_block_order_is_a_permutation() -> None:
    perm = block_order(rows=100, seed=0, epoch=1, block=2, shuffle=True)
    assert sorted(perm.tolist()) == list(range(100))
    assert perm.tolist() != list(range(100))
    again = block_order(rows=100, seed=0, epoch=1, block=2, shuffle=True)
    assert perm.tolist() == again.tolist()
