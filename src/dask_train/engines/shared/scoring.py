"""The score keeper the scorer role and the array engine share: a score's record, and the last few
scored parameter snapshots.

Scores reach the controller within milliseconds, so the one that stops a job is among the last
few taken: keeping :data:`SNAPSHOTS` of them lets the result hold the parameters that earned the
stopping score, not those of a few asynchronous steps later.

Examples
--------
>>> keeper = ScoreKeeper()
>>> event = keeper.record(step=10, samples=640, scores={"loss": 0.5, "accuracy": float("nan")},
...                       snapshot="params@10")
>>> event.nonfinite, keeper.get(10)
(['accuracy'], 'params@10')
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from dask_train.engines._events import Score

#: Scored snapshots kept (the newest).
SNAPSHOTS = 4


def score_event(*, step: int, samples: int, scores: Mapping[str, float],
                wall: float | None = None) -> Score:
    """The :class:`~dask_train.engines._events.Score` of ``scores``, naming those not finite."""
    return Score(step=int(step), samples=int(samples), metrics=dict(scores),
                 nonfinite=sorted(k for k, v in scores.items() if not math.isfinite(v)),
                 wall=time.time() if wall is None else wall)


class ScoreKeeper:
    """Builds score events and keeps the parameters of the last :data:`SNAPSHOTS` scored steps."""

    def __init__(self, keep: int = SNAPSHOTS) -> None:
        self.keep = keep
        self.snapshots: dict[int, Any] = {}

    def __contains__(self, step: int) -> bool:
        return step in self.snapshots

    def record(self, *, step: int, samples: int, scores: Mapping[str, float],
               snapshot: Any = None) -> Score:
        """The score's event; ``snapshot`` (the scored parameters) is kept under its step."""
        self.keep_snapshot(step, snapshot)
        return score_event(step=step, samples=samples, scores=scores)

    def keep_snapshot(self, step: int, snapshot: Any) -> None:
        """Keep ``snapshot`` as the parameters of ``step``, dropping the oldest beyond ``keep``."""
        self.snapshots[int(step)] = snapshot
        for old in sorted(self.snapshots)[:-self.keep]:
            del self.snapshots[old]

    def get(self, step: int | None) -> Any:
        """The snapshot kept for ``step``, or None."""
        return None if step is None else self.snapshots.get(int(step))
