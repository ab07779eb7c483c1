"""What every job returns, whatever ran it: the base of ``FitResult`` and ``RunResult``, and the
one builder of the fields they share from the controller's outcome."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: pandas loads when a result is built (0.45 s of start-up)
    import pandas as pd

    from dask_train.controller._controller import Outcome
    from dask_train.policy._placement import Roles


@dataclass(kw_only=True)
class JobResult:
    """The outcome every job has; see :class:`~dask_train.FitResult` and
    :class:`~dask_train.RunResult` for each field's meaning in their jobs."""

    history: pd.DataFrame
    stopped_by: str
    steps: int
    samples: int
    epochs_completed: int
    wall_s: float
    ledger: pd.DataFrame
    roles: Roles
    failures: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    departures: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[dict[str, Any]] = field(default_factory=list)
    generations: int = 1
    timings: dict[str, float] = field(default_factory=dict)
    started_at: float = 0.0

    @property
    def samples_per_s(self) -> float:
        """Mean training throughput over the whole job."""
        return self.samples / self.wall_s if self.wall_s > 0 else math.nan


def job_fields(outcome: Outcome, *, wall_s: float, clock: Mapping[str, float]) -> dict[str, Any]:
    """The :class:`JobResult` fields of a job that ran ``outcome``; ``clock``: the api's own
    phases (``fit``: its start, ``connect``, ``persist``)."""
    from dask_train.report import history_frame, ledger_frame

    log = outcome.log
    return dict(history=history_frame(log.records), stopped_by=outcome.stopped_by,
                steps=outcome.ending.steps, samples=outcome.ending.samples,
                epochs_completed=outcome.epochs_completed, wall_s=wall_s,
                ledger=ledger_frame(outcome.ledger), roles=outcome.roles,
                failures=list(log.failures), checkpoints=list(log.checkpoints),
                departures=list(log.departures), arrivals=list(log.arrivals),
                generations=log.generations,
                timings=phase_timings(clock, log), started_at=log.started)


def phase_timings(clock: Mapping[str, float], log: Any) -> dict[str, float]:
    """``timings`` from the api's clock (fit start, connect, persist) and the controller's log
    (when roles were up, the first step, the stop)."""
    end = time.time()
    start = float(clock.get("fit", log.started))
    roles_up = log.roles_up_at or log.started
    first = log.first_step_at or roles_up
    stop = log.stop_at or end
    return {"connect": round(float(clock.get("connect", 0.0)), 4),
            "persist": round(float(clock.get("persist", 0.0)), 4),
            "roles": round(max(0.0, roles_up - log.started), 4),
            "first_step": round(max(0.0, first - roles_up), 4),
            "train": round(max(0.0, stop - first), 4),
            "teardown": round(max(0.0, end - stop), 4),
            "total": round(end - start, 4)}
