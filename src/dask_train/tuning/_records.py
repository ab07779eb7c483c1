"""The records of a search's trials, and what is read from them alone: the best so far.

Below both :mod:`._result` (the :class:`SearchResult` a search returns) and :mod:`._plot` (its
picture), so neither needs the other's module to know what a trial is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

#: A trial's states: ran to its end; stopped early by the pruner; raised or lost its worker
#: (after its retries, if the search allowed any); stopped by Ctrl-C (not counted for the best).
STATES = ("complete", "pruned", "failed", "interrupted")


@dataclass
class TrialRecord:
    """One trial as the search saw it (times in seconds since the search started).

    ``attempts`` counts the runs of the trial: more than one when a run lost a worker and the
    search retried it (``dt.search(..., retries=N)``); ``retried_after`` holds the errors of the
    runs that were retried, oldest first; ``workers`` are those of the last run.
    """

    number: int
    params: dict[str, Any]
    state: str
    score: float
    start_s: float
    end_s: float
    workers: list[str]
    stopped_by: str = ""
    error: str = ""
    points: list[tuple[float, float]] = field(default_factory=list)  # (search time, score)
    attempts: int = 1
    retried_after: list[str] = field(default_factory=list)
    model: Any = None
    result: Any = None


def best_so_far(records: list[TrialRecord], mode: str) -> pd.DataFrame:
    """``time_s`` (since the search started) and the best ``score`` any trial had reached by
    then, one row per score reported (pruned and interrupted trials' scores included: they
    were reached); ``mode`` is ``"max"`` or ``"min"``."""
    points = sorted(p for r in records if r.state != "failed" for p in r.points)
    rows, best = [], math.nan
    for t, value in points:
        if math.isnan(best) or (value > best if mode == "max" else value < best):
            best = value
        rows.append({"time_s": t, "score": best})
    return pd.DataFrame(rows, columns=["time_s", "score"])
