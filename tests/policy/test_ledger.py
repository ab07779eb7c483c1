"""The ledger hands out each block once per epoch, local blocks first; blocks move only to idle trainers."""

from __future__ import annotations

import json

import pytest

from dask_train.data import block_order
from dask_train.errors import InvalidInput
from dask_train.policy import Assignment, Block, Ledger
from dask_train.policy._ledger import patch_positions


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


# -- losing trainers, resuming, joining -------------------------------------------------------------
def _sized(holders: list[str]) -> list[Block]:
    """Blocks of unequal sizes, so that a mixed-up skip or requeue shows in the row counts."""
    blocks, start = [], 0
    for i, h in enumerate(holders):
        rows = 10 + 3 * i
        blocks.append(Block(i, start, rows, (h,)))
        start += rows
    return blocks


class _Sim:
    """Trainers with bounded queues (``depth`` blocks prefetched) reading whole blocks in turn.

    ``applied`` is the truth the parameter servers would hold: rows of each (epoch, block) that
    reached the model, whoever read them.
    """

    def __init__(self, ledger: Ledger, trainers: list[int], depth: int = 2) -> None:
        self.ledger, self.depth = ledger, depth
        self.queues: dict[int, list] = {t: [] for t in trainers}
        self.applied: dict[tuple[int, int], int] = {}
        self.segments: list[tuple[int, int, int, int]] = []

    def fill(self, t: int) -> None:
        while len(self.queues[t]) < self.depth:
            a = self.ledger.next_for(t)
            if a is None:
                return
            self.queues[t].append(a)

    def read(self, t: int, limit: int | None = None) -> int:
        """Trainer ``t`` reads its front block (at most ``limit`` rows) and reports; rows read."""
        self.fill(t)
        if not self.queues[t]:
            return 0
        a = self.queues[t][0]
        n = a.rows - a.skip if limit is None else min(limit, a.rows - a.skip)
        done = a.skip + n == a.rows
        if done:
            self.queues[t].pop(0)
        else:
            self.queues[t][0] = Assignment(a.epoch, a.block, a.trainer, a.rows, a.local, a.skip + n)
        self.ledger.consumed(epoch=a.epoch, block=a.block, trainer=t, rows=n, done=done)
        self.applied[(a.epoch, a.block)] = self.applied.get((a.epoch, a.block), 0) + n
        self.segments.append((a.epoch, a.block, a.skip, a.skip + n))
        return n

    def drain(self) -> None:
        while self.queues:
            for t in sorted(self.queues):
                if self.read(t) == 0 and not self.queues[t]:
                    del self.queues[t]


def _assert_exactly_once(applied: dict[tuple[int, int], int], blocks: list[Block], epochs: int) -> None:
    expected = {(e, b.index): b.rows for e in range(epochs) for b in blocks}
    assert applied == expected


def test_retire_mid_epoch_feeds_every_row_exactly_once() -> None:
    blocks = _sized(["a", "b", "c", "a", "b", "c", "a", "b", "c"])
    ledger = Ledger(blocks, ["a", "b", "c"], epochs=3, shuffle=True, seed=7)
    sim = _Sim(ledger, [0, 1, 2])
    for _ in range(2):
        for t in (0, 1, 2):
            sim.read(t)
    # Trainer 1 dies mid-block: 4 rows of its front block were pushed and applied, not reported;
    # the block behind it in its queue was never started.
    sim.fill(1)
    front, behind = sim.queues.pop(1)
    sim.applied[(front.epoch, front.block)] = sim.applied.get((front.epoch, front.block), 0) + 4
    moved = ledger.retire(1, applied={(front.epoch, front.block): front.skip + 4})

    assert moved[:2] == [(front.epoch, front.block), (behind.epoch, behind.block)]
    with pytest.raises(RuntimeError, match="retired"):
        ledger.next_for(1)
    ledger.consumed(epoch=front.epoch, block=front.block, trainer=1, rows=4, done=False)  # late: ignored
    assert ledger.retire(1) == []
    sim.drain()

    _assert_exactly_once(sim.applied, blocks, 3)
    assert ledger.epochs_completed == 3
    records = {(r["epoch"], r["block"]): r for r in ledger.records()}
    resumed = records[(front.epoch, front.block)]
    assert resumed["skip"] == front.skip + 4 and resumed["moved_from"] == 1 and resumed["trainer"] != 1
    assert records[(behind.epoch, behind.block)]["skip"] == 0
    assert all(r["consumed"] == r["rows"] and r["done"] for r in records.values())
    # The dead trainer's pending blocks moved to a survivor; its worker "b" gets no new epoch plan.
    later = [r for r in ledger.records() if r["epoch"] > front.epoch]
    assert later and all(r["trainer"] != 1 for r in later)


def test_retire_prefers_holders_then_least_loaded() -> None:
    blocks = [Block(0, 0, 10, ("a", "c")), Block(1, 10, 10, ("a",)), Block(2, 20, 10, ("b",))]
    ledger = Ledger(blocks, ["a", "b", "c"], epochs=1, shuffle=False, seed=0)
    first = ledger.next_for(0)
    second = ledger.next_for(0)
    assert first is not None and second is not None and {first.block, second.block} == {0, 1}
    ledger.retire(0)
    # "c" holds block 0 as well: the local survivor takes it. Block 1 has no other holder: it goes
    # to the least loaded survivor (a tie, the lower index), and is read before its own blocks.
    a, b, c = ledger.next_for(2), ledger.next_for(1), ledger.next_for(1)
    assert a is not None and (a.block, a.local) == (0, True)
    assert b is not None and (b.block, b.local) == (1, False)
    assert c is not None and (c.block, c.local) == (2, True)
    moved = {r["block"]: r["moved_from"] for r in ledger.records() if r["trainer"] != 0}
    assert moved == {0: 0, 1: 0, 2: None}


def test_retire_marks_fully_applied_blocks_done() -> None:
    ledger = Ledger(_sized(["a", "a"]), ["a", "b"], epochs=1, shuffle=False, seed=0)
    a = ledger.next_for(0)
    assert a is not None
    moved = ledger.retire(0, applied={(0, a.block): a.rows})
    assert (0, a.block) not in moved
    entry = ledger.entries[(0, a.block)]
    assert entry.done and entry.consumed == entry.rows and entry.trainer == 0


def test_requeued_blocks_come_first_even_from_an_earlier_epoch() -> None:
    ledger = Ledger(_sized(["a", "a", "a"]), ["a", "b"], epochs=2, shuffle=False, seed=0)
    taken = ledger.next_for(1)
    assert taken is not None and taken.epoch == 0
    while True:
        a = ledger.next_for(0)
        assert a is not None
        ledger.consumed(epoch=a.epoch, block=a.block, trainer=0, rows=a.rows, done=True)
        if a.epoch == 1:
            break
    assert ledger.epoch >= 1  # epoch 1 begun, perhaps epoch 2 prefetched
    ledger.retire(1, applied={(0, taken.block): 3})
    again = ledger.next_for(0)
    assert again is not None
    assert (again.epoch, again.block, again.skip) == (0, taken.block, 3)
    ledger.consumed(epoch=0, block=taken.block, trainer=0, rows=taken.rows - 3, done=True)
    assert ledger.epoch_complete(0)


def test_retiring_the_last_trainer_raises_and_changes_nothing() -> None:
    ledger = Ledger(_sized(["a"]), ["a", "b"], epochs=1, shuffle=False, seed=0)
    ledger.retire(1)
    a = ledger.next_for(0)
    assert a is not None
    before = ledger.state()
    with pytest.raises(RuntimeError, match="no trainer"):
        ledger.retire(0)
    assert ledger.state() == before


def test_report_beyond_the_block_is_refused() -> None:
    ledger = Ledger(_sized(["a"]), ["a", "b"], epochs=1, shuffle=False, seed=0)
    a = ledger.next_for(0)
    assert a is not None
    ledger.retire(0, applied={(0, a.block): 4})
    b = ledger.next_for(1)
    assert b is not None and b.skip == 4
    with pytest.raises(RuntimeError, match="after skipping 4"):
        ledger.consumed(epoch=0, block=b.block, trainer=1, rows=b.rows, done=True)
    ledger.consumed(epoch=0, block=b.block, trainer=1, rows=b.rows - 4, done=True)
    assert ledger.epochs_completed == 1


def _merged(segments: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Join a block's consecutive pieces, so an interrupted read compares with a whole one."""
    out: list[tuple[int, int, int, int]] = []
    for e, b, start, stop in segments:
        if out and out[-1][:2] == (e, b) and out[-1][3] == start:
            out[-1] = (e, b, out[-1][2], stop)
        elif stop > start:
            out.append((e, b, start, stop))
    return out


def _resume(ledger: Ledger, blocks: list[Block], trainers: list[str], *, epochs: int = 3) -> Ledger:
    state = json.loads(json.dumps(ledger.state()))
    return Ledger.from_state(blocks, trainers, epochs=epochs, shuffle=True, seed=5, state=state)


def _read_rows(sim: _Sim, t: int, rows: int) -> None:
    """Trainer ``t`` reads ``rows`` rows, ending mid-block when they run out there."""
    while rows > 0:
        n = sim.read(t, limit=rows)
        if n == 0:
            return
        rows -= n


@pytest.mark.parametrize("stops", [[0], [10], [23], [37, 38], [100, 101, 150], [205, 206, 207], [999]])
def test_resume_on_one_trainer_reads_the_uninterrupted_sequence(stops: list[int]) -> None:
    blocks = _sized(["a"] * 6)  # 105 rows per epoch, 3 epochs
    whole = _Sim(Ledger(blocks, ["a"], epochs=3, shuffle=True, seed=5), [0])
    whole.drain()
    expected = whole.segments
    reference = [(r["epoch"], r["block"]) for r in whole.ledger.records()]

    ledger = Ledger(blocks, ["a"], epochs=3, shuffle=True, seed=5)
    segments: list[tuple[int, int, int, int]] = []
    done = 0
    for i, stop in enumerate(stops):
        sim = _Sim(ledger, [0])
        _read_rows(sim, 0, stop - done)
        done = stop
        segments += sim.segments
        # A restarted cluster: the trainer is on another worker.
        ledger = _resume(ledger, blocks, [f"host-{i}"])
    sim = _Sim(ledger, [0])
    sim.drain()
    segments += sim.segments

    assert _merged(segments) == expected
    assert [(r["epoch"], r["block"]) for r in ledger.records()] == reference
    assert ledger.epochs_completed == 3


def test_resume_with_fewer_and_more_trainers() -> None:
    blocks = _sized(["a", "b", "c"] * 4)
    for after in (["x", "b"], ["a", "b", "c", "d"]):
        ledger = Ledger(blocks, ["a", "b", "c"], epochs=3, shuffle=True, seed=5)
        sim = _Sim(ledger, [0, 1, 2])
        for _ in range(7):
            for t in (0, 1, 2):
                sim.read(t)
        _read_rows(sim, 1, 5)  # trainer 1 stops mid-block
        for t in (0, 1, 2):
            sim.fill(t)  # blocks handed out and queued, never started
        resumed = _resume(ledger, blocks, after)
        rest = _Sim(resumed, list(range(len(after))))
        rest.drain()
        total = dict(sim.applied)
        for key, rows in rest.applied.items():
            total[key] = total.get(key, 0) + rows
        _assert_exactly_once(total, blocks, 3)
        assert resumed.epochs_completed == 3
        late = [r for r in resumed.records() if r["epoch"] == 2]
        assert {r["trainer"] for r in late} == set(range(len(after)))


def test_resume_with_the_same_trainers_keeps_their_lists() -> None:
    blocks = _sized(["a", "b"] * 4)
    ledger = Ledger(blocks, ["a", "b"], epochs=2, shuffle=True, seed=5)
    for t in (0, 1, 0):
        ledger.next_for(t)
    resumed = _resume(ledger, blocks, ["a", "b"], epochs=2)
    expected = [(a.epoch, a.block) for a in (ledger.next_for(1), ledger.next_for(0), ledger.next_for(0))
                if a is not None]
    assert len(expected) == 3
    # The resumed ledger first re-hands the unreported blocks, then continues as the original would.
    for t, (e, b) in zip((0, 1, 0), list(ledger.entries)[:3]):
        a = resumed.next_for(t)
        assert a is not None and (a.epoch, a.block) == (e, b)
    got = [(a.epoch, a.block) for a in (resumed.next_for(1), resumed.next_for(0), resumed.next_for(0))
           if a is not None]
    assert got == expected


def test_state_is_json_and_checked_against_the_data() -> None:
    blocks = _sized(["a", "b"])
    ledger = Ledger(blocks, ["a", "b"], epochs=2, shuffle=True, seed=5)
    ledger.next_for(0)
    ledger.retire(1)
    state = json.loads(json.dumps(ledger.state()))
    assert state["retired"] == [1] and state["epoch"] == 0
    with pytest.raises(InvalidInput, match="written for 2 data blocks of .* rows in all, the data has 3"):
        Ledger.from_state(_sized(["a", "b", "c"]), ["a"], epochs=2, shuffle=True, seed=5, state=state)
    with pytest.raises(InvalidInput, match="version"):
        Ledger.from_state(blocks, ["a"], epochs=2, shuffle=True, seed=5, state={**state, "version": 99})


def test_added_trainer_is_planned_from_the_next_epoch() -> None:
    blocks = _sized(["a", "b", "c"] * 3)
    ledger = Ledger(blocks, ["a", "b"], epochs=2, shuffle=True, seed=5)
    sim = _Sim(ledger, [0, 1])
    for t in (0, 1):
        sim.read(t)
    new = ledger.add_trainer("c")
    assert new == 2
    sim.drain()
    records = ledger.records()
    assert not any(r["trainer"] == 2 for r in records)
    # Epoch 0 was planned without it and read in full by the others.
    _assert_exactly_once(sim.applied, blocks, 2)

    ledger = Ledger(blocks, ["a", "b"], epochs=2, shuffle=True, seed=5)
    sim = _Sim(ledger, [0, 1])
    sim.read(0)
    ledger.add_trainer("c")
    sim.queues[2] = []
    sim.drain()
    _assert_exactly_once(sim.applied, blocks, 2)
    epoch1 = [r for r in ledger.records() if r["epoch"] == 1]
    held_by_c = {b.index for b in blocks if b.holders == ("c",)}
    assert {r["block"] for r in epoch1 if r["trainer"] == 2} == held_by_c
    assert all(r["local"] for r in epoch1)


def test_resume_with_fewer_epochs_reads_nothing_beyond_them() -> None:
    blocks = _sized(["a"] * 3)
    ledger = Ledger(blocks, ["a"], epochs=3, shuffle=True, seed=5)
    sim = _Sim(ledger, [0])
    _read_rows(sim, 0, 70)  # into epoch 1 (each epoch has 39 rows)
    assert ledger.epoch >= 1  # epoch 1 begun, perhaps epoch 2 prefetched
    resumed = _resume(ledger, blocks, ["a"], epochs=1)
    rest = _Sim(resumed, [0])
    rest.drain()
    assert rest.segments == []  # epoch 0 was read in full before the checkpoint
    assert resumed.epochs_completed == 1
    assert resumed.retired == frozenset()


def test_positions_count_the_blocks_read_before_them_whose_reports_are_missing() -> None:
    # Trainer 0 was given blocks 0, 2 and 4 and reported only block 0; its position (from the
    # survivors of a killed sync rank, straight from memory) is 5 rows into block 4: block 2
    # was read to the end, its report still on its way. Trainer 1 is 3 rows into block 1, with
    # block 3 given after it: block 3 is not read yet.
    ledger = Ledger(_blocks(["a", "b", "a", "b", "a", "b"]), ["a", "b"], epochs=1,
                    shuffle=False, seed=0)
    given = {t: [ledger.next_for(t).block for _ in range(3 if t == 0 else 2)] for t in (0, 1)}
    assert given == {0: [0, 2, 4], 1: [1, 3]}
    ledger.consumed(epoch=0, block=0, trainer=0, rows=10, done=True)
    state = patch_positions(ledger.state(), {0: [0, 4, 5], 1: [0, 1, 3]})
    names = state["entry_fields"]
    entries = {row[names.index("block")]: dict(zip(names, row)) for row in state["entries"]}
    assert (entries[2]["consumed"], entries[2]["done"]) == (10, True)  # read before block 4
    assert (entries[4]["consumed"], entries[4]["done"]) == (5, False)
    assert (entries[1]["consumed"], entries[1]["done"]) == (3, False)
    assert (entries[3]["consumed"], entries[3]["done"]) == (0, False)  # after trainer 1's place
    # Resumed from it, block 2 is not read again; blocks 1, 3 and 4 go on where they were.
    again = Ledger.from_state(_blocks(["a", "b", "a", "b", "a", "b"]), ["a", "b"], epochs=1,
                              shuffle=False, seed=0, state=json.loads(json.dumps(state)))
    rest = [a for t in (0, 1) for a in iter(lambda t=t: again.next_for(t), None)]
    assert sorted((a.block, a.skip) for a in rest) == [(1, 3), (3, 0), (4, 5), (5, 0)]


def _applied(ledger: Ledger) -> int:
    return sum(int(r["consumed"]) for r in ledger.records())


def test_rows_applied_before_a_resume_are_in_the_records_until_read_again() -> None:
    # A hand-over's next generation starts from a ledger whose partly read block waits to be
    # read again (skip = the rows applied). A job stopped before its new reader reported it
    # (or before it was handed out again) showed those rows nowhere: fewer than the servers
    # applied (a SIGTERM departure: 64 rows of 91,256).
    blocks = _blocks(["a", "b"])
    ledger = Ledger(blocks, ["a", "b"], epochs=1, shuffle=False)
    first = ledger.next_for(0)
    ledger.consumed(epoch=first.epoch, block=first.block, trainer=0, rows=4, done=False)
    assert _applied(ledger) == 4
    state = json.loads(json.dumps(ledger.state()))
    again = Ledger.from_state(blocks, ["a", "b"], epochs=1, shuffle=False, seed=0, state=state)
    assert _applied(again) == 4  # waiting to be read again
    a = again.next_for(0)
    assert (a.block, a.skip) == (first.block, 4)
    assert _applied(again) == 4  # handed out, not yet reported
    again.consumed(epoch=a.epoch, block=a.block, trainer=0, rows=6, done=True)
    assert _applied(again) == 10
    assert [r["consumed"] for r in again.records()] == [10]


def test_rows_a_lost_trainer_applied_are_in_the_records_until_read_again() -> None:
    ledger = Ledger(_blocks(["a", "b"]), ["a", "b"], epochs=1, shuffle=False)
    a = ledger.next_for(0)
    ledger.retire(0, applied={(a.epoch, a.block): 7})
    assert _applied(ledger) == 7
    [record] = ledger.records()
    assert (record["block"], record["consumed"], record["done"]) == (a.block, 7, False)
    moved = ledger.next_for(1)
    assert moved.skip == 7 and _applied(ledger) == 7
