"""The records of a search's trials, and what is read from them alone: the best so far.

Below both :mod:`._result` (the :class:`SearchResult` a search returns) and :mod:`._plot` (its
picture), so neither needs the other's module to know what a trial is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

#: A trial's states: ran to its end; stopped early by the pruner; raised or lost its worker;
#: stopped by Ctrl-C (not counted for the best).
STATES = ("complete", "pruned", "failed", "interrupted")


@dataclass
class TrialRecord:
    """One trial as the search saw it (times in seconds since the search started)."""

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
