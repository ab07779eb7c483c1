"""The score keeper the scorer role and the array engine share: a score's record, and the last few
scored parameter snapshots; and the scorer's schedule, which keeps it within its CPU budget.

A score reaches the controller within milliseconds on an idle machine, but may take seconds on
a loaded one, while the scorer goes on scoring newer parameters. So the keeper holds the newest
:data:`SNAPSHOTS` snapshots, and besides them every snapshot taken in the last :data:`WINDOW_S`
seconds, as long as those extra ones stay within :data:`EXTRA_BYTES`: the result holds the
parameters that earned the stopping score, not those of a few asynchronous steps later (and the
controller leaves the scores queued behind the stopping one out of the history).

The scorer shares the cores with the trainers, so it must not take more than its share of them:
:class:`ScoreSchedule` scores every ``score_every`` seconds, and skips a score that would lift
the CPU spent scoring above ``budget`` of one core over the time it has run, scoring again at
the first due time that keeps within it. A slow metric then spaces scores out instead of
slowing the trainers.

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

#: Scored snapshots always kept (the newest).
SNAPSHOTS = 4
#: Older snapshots are kept this long too: the controller's lag behind the scorer on a loaded
#: machine (seconds), with room to spare.
WINDOW_S = 30.0
#: At most this many bytes of snapshots are kept beyond the newest :data:`SNAPSHOTS`.
EXTRA_BYTES = 256 * 2**20


def score_event(*, step: int, samples: int, scores: Mapping[str, float],
                wall: float | None = None) -> Score:
    """The :class:`~dask_train.engines._events.Score` of ``scores``, naming those not finite."""
    return Score(step=int(step), samples=int(samples), metrics=dict(scores),
                 nonfinite=sorted(k for k, v in scores.items() if not math.isfinite(v)),
                 wall=time.time() if wall is None else wall)


class ScoreKeeper:
    """Builds score events and keeps the parameters of recent scored steps: the newest ``keep``,
    and older ones taken within ``window_s`` seconds while they fit in ``extra_bytes``."""

    def __init__(self, keep: int = SNAPSHOTS, *, window_s: float = WINDOW_S,
                 extra_bytes: int = EXTRA_BYTES) -> None:
        self.keep, self.window_s, self.extra_bytes = keep, float(window_s), int(extra_bytes)
        self.snapshots: dict[int, Any] = {}
        self._taken: dict[int, tuple[float, int]] = {}  # step -> (monotonic time, bytes)

    def __contains__(self, step: int) -> bool:
        return step in self.snapshots

    def record(self, *, step: int, samples: int, scores: Mapping[str, float],
               snapshot: Any = None) -> Score:
        """The score's event; ``snapshot`` (the scored parameters) is kept under its step."""
        self.keep_snapshot(step, snapshot)
        return score_event(step=step, samples=samples, scores=scores)

    def keep_snapshot(self, step: int, snapshot: Any, *, now: float | None = None) -> None:
        """Keep ``snapshot`` as the parameters of ``step``; drop those no longer kept."""
        now = time.monotonic() if now is None else now
        self.snapshots[int(step)] = snapshot
        self._taken[int(step)] = (now, _nbytes(snapshot))
        steps = sorted(self.snapshots)
        extra = 0
        for old in reversed(steps[:-self.keep] if self.keep else steps):
            taken, size = self._taken[old]
            if now - taken > self.window_s or extra + size > self.extra_bytes:
                del self.snapshots[old], self._taken[old]
            else:
                extra += size

    def get(self, step: int | None) -> Any:
        """The snapshot kept for ``step``, or None."""
        return None if step is None else self.snapshots.get(int(step))


def _nbytes(snapshot: Any) -> int:
    """The bytes of the arrays in ``snapshot`` (an array, or a tuple, list or dict of them)."""
    if isinstance(snapshot, (tuple, list)):
        return sum(_nbytes(part) for part in snapshot)
    if isinstance(snapshot, dict):
        return sum(_nbytes(part) for part in snapshot.values())
    return int(getattr(snapshot, "nbytes", 0) or 0)


class ScoreSchedule:
    """When the scorer scores: every ``every`` seconds, within ``budget`` of one core.

    Before each score the CPU spent on the scores so far is at most ``budget`` times the
    seconds since ``start`` (a score is never cut short, so the last one may lift it above
    until the next is due). Scores are due on the grid ``start + k * every``; a slow score is
    followed by the next at once (a fixed rate, not a fixed pause), an expensive one by the
    first due time within the budget, and the due times passed over are counted as skipped. A
    due time that found nothing new to score (the parameters unchanged since the last score, or
    not published yet) counts as ``unchanged``: its CPU (the pull) is counted, no score is.

    Examples
    --------
    >>> clock = ScoreSchedule(every=0.1, budget=0.25, start=0.0)
    >>> clock.due
    0.1
    >>> clock.done(cpu_s=0.05, started=0.1)  # 0.05 CPU-s allowed once 0.2 s have passed
    >>> round(clock.due, 3), clock.skipped
    (0.2, 0)
    >>> clock.done(cpu_s=0.1, started=0.2)  # 0.15 CPU-s in all: not before 0.6 s
    >>> round(clock.due, 3), clock.skipped
    (0.6, 3)
    >>> clock.done(cpu_s=0.001, started=0.6, scored=False)  # the same parameters: not scored
    >>> round(clock.due, 3), clock.scores, clock.unchanged
    (0.7, 2, 1)
    """

    def __init__(self, *, every: float, budget: float | None, start: float) -> None:
        self.every, self.budget, self.start = float(every), budget, float(start)
        self.due = self.start + self.every
        self.cpu_s, self.scores, self.skipped, self.unchanged = 0.0, 0, 0, 0

    def wait_s(self, now: float) -> float:
        """Seconds until the next score is due."""
        return max(0.0, self.due - now)

    def done(self, *, cpu_s: float, started: float, scored: bool = True) -> None:
        """Count a score begun at ``started`` that took ``cpu_s`` CPU seconds (``scored``
        False: a due time that found nothing new to score); set the next due time."""
        self.cpu_s += max(0.0, cpu_s)
        if scored:
            self.scores += 1
        else:
            self.unchanged += 1
        due = max(self.due + self.every, started)
        if self.budget:
            earliest = self.start + self.cpu_s / self.budget
            if earliest > due:
                passed = math.ceil((earliest - due) / self.every - 1e-9)
                self.skipped += passed
                due += passed * self.every
        self.due = due

    def spent(self, cpu_s: float) -> None:
        """Count CPU spent scoring outside the schedule (the final score, which is not
        skipped: the result needs it)."""
        self.cpu_s += max(0.0, cpu_s)

    def record(self, now: float) -> dict[str, Any]:
        """What the scorer spent, for the result: CPU, wall seconds, the budget, the counts."""
        return {"cpu_s": self.cpu_s, "wall_s": max(0.0, now - self.start),
                "budget": self.budget, "scores": self.scores, "skipped": self.skipped,
                "unchanged": self.unchanged, "score_every": self.every}
