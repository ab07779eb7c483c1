"""The engine protocol's events: typed records on both ends, plain dicts on the wire."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest

from dask_train.engines._events import (
    Block,
    Epochs,
    Exit,
    NonFinite,
    Paused,
    Progress,
    Score,
    Started,
    Stats,
    from_message,
)
from dask_train.engines.scoring.keeper import ScoreKeeper

EVENTS = [
    Started(trainer=0),
    Block(trainer=1, epoch=0, block=3, rows=500, done=True, steps=8),
    Paused(trainer=0, id=2, steps=40, position=[0, 3, 128], rng="AAEC"),
    Paused(trainer=1, id=2, steps=40, position=None, rng=""),
    Exit(trainer=1, steps=80),
    Score(step=10, samples=640, metrics={"loss": 0.5, "accuracy": 0.9}, nonfinite=[], wall=1.5),
    NonFinite(trainer=0, loss="nan", step=3, epoch=0, block=1, count=2),
    Stats(role="ps", index=0, figures={"step": 5, "updates": 5, "updates_total": 9}),
    Epochs(completed=2),
    Progress(step=99),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_travels_as_msgpack_and_comes_back_as_itself(event: object) -> None:
    wire = msgpack.unpackb(msgpack.packb(event.message()))  # type: ignore[attr-defined]
    assert from_message(wire) == event


def test_the_workers_stamp_is_kept_by_scores_and_dropped_elsewhere() -> None:
    # The scheduler adds the sending worker to every dict a worker logs (log_worker_event).
    score = from_message({**Score(step=1, samples=2, metrics={"loss": 1.0}).message(),
                          "worker": "tcp://w:1"})
    assert isinstance(score, Score) and score.worker == "tcp://w:1"
    assert score.metrics == {"loss": 1.0}  # not a metric
    block = from_message({**EVENTS[1].message(), "worker": "tcp://w:1"})
    assert block == EVENTS[1]


def test_a_bad_message_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="unknown engine event kind 'blok'"):
        from_message({"kind": "blok", "trainer": 0})
    with pytest.raises(ValueError, match="unexpected fields \\['rowz'\\]"):
        from_message({**EVENTS[1].message(), "rowz": 3})
    with pytest.raises(TypeError):
        from_message({"kind": "exit", "trainer": 0})  # steps missing


def test_the_score_keeper_names_nonfinite_scores_and_keeps_the_last_snapshots() -> None:
    keeper = ScoreKeeper(keep=2, window_s=0.0)
    first = keeper.record(step=1, samples=10, scores={"loss": math.inf, "accuracy": 0.5},
                          snapshot="p1")
    assert first.nonfinite == ["loss"] and first.metrics["accuracy"] == 0.5
    for step in (2, 3):
        keeper.record(step=step, samples=10 * step, scores={"loss": 1.0}, snapshot=f"p{step}")
    assert 1 not in keeper and keeper.get(1) is None
    assert keeper.get(3) == "p3" and keeper.get(None) is None


def test_the_score_keeper_keeps_recent_snapshots_for_a_controller_that_lags() -> None:
    # A loaded machine's controller may hear of a score after several newer ones: a snapshot
    # stays for window_s seconds beyond the newest `keep`, within extra_bytes.
    params = np.zeros(100, dtype=np.float32)  # 400 bytes
    keeper = ScoreKeeper(keep=2, window_s=10.0, extra_bytes=1000)
    for step in range(1, 6):  # one score a second
        keeper.keep_snapshot(step, (None, params.copy(), None), now=float(step))
    # 4 and 5 are the newest; 3 and 2 (800 bytes) fit in the window and the bytes; 1 does not fit.
    assert sorted(keeper.snapshots) == [2, 3, 4, 5]
    keeper.keep_snapshot(6, (None, params.copy(), None), now=13.5)
    # At 13.5 s, 3 (taken at 3 s) is older than the window; 4 is kept beyond the newest two.
    assert sorted(keeper.snapshots) == [4, 5, 6]
