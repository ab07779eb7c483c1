"""One trial of a search: what it runs on, what it reports, how it stops, what it returns.

A trial runs in its own client thread (a Trainer's ``fit`` drives its job from any thread with
``Client.sync``) on the gang of workers the search reserved for it (see :mod:`._gangs`), inside
:func:`~dask_train.policy._scope.use_workers`, so the job places its roles and spreads its data
on those workers only. Each score it reports goes to optuna's pruner; a pruned trial stops through
the job's normal stop path (the stop condition :class:`Pruned`), so its workers are free for the
next trial within a score interval. A trial is pruned only when the pruner's decision ended it
(:attr:`Outcome.pruned`): one that reached its own stop condition or its planned training at the
same score is complete.
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from dask_train.errors import WorkerLost
from dask_train.policy._placement import Placement
from dask_train.policy.callbacks import Callback
from dask_train.policy.stop import StopCondition

#: (value, step) -> True when the trial should stop (pruned, or the search is stopping).
Report = Callable[[float, int], bool]


@dataclass
class TrialContext:
    """What a running trial gets from the search.

    Attributes
    ----------
    number : int
        optuna's trial number.
    params : dict
        The trial's hyper-parameters (space values, choices mapped back).
    gang : list of str
        The workers reserved for it.
    report : callable
        ``report(value, step) -> stop?``: a score of the search's metric at a step (samples seen,
        boosting rounds): optuna's pruner, the search's stop conditions, its best-so-far curve.
    stopping : threading.Event
        Set when the search stops (Ctrl-C, a search stop condition): end as soon as possible.
    cache : dict
        Shared by the search's trials: data persisted on a gang, by key.
    """

    number: int
    params: dict[str, Any]
    gang: list[str]
    report: Report
    stopping: threading.Event
    cache: dict[Any, Any]
    pruned: bool = False


@dataclass
class Outcome:
    """What a trial returns: its score on the validation data and the model that earned it.

    ``history`` has ``time_s`` (seconds since the trial started) and the metric, one row per
    score; ``result`` is the framework's own result (a :class:`~dask_train.FitResult`, a fitted
    estimator).
    """

    score: float
    model: Any
    history: pd.DataFrame
    stopped_by: str = ""
    result: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    #: Whether the pruner's decision ended the trial. A decision at the score where the trial
    #: reached its own stop condition or its planned training ends nothing: that trial is complete.
    pruned: bool = False


class TrialRunner(ABC):
    """How one kind of model is searched: checks, the workers a trial needs, one trial's run."""

    kind = ""
    data: Any = None  # the search's SearchData: lazy arrays for the checks, then persisted

    @abstractmethod
    def problems(self) -> list[str]:
        """Every problem with the model, space and metric, found in the client before any work."""

    @abstractmethod
    def workers_needed(self, params: Mapping[str, Any]) -> int:
        """How many workers a trial with ``params`` reserves."""

    def placement(self, params: Mapping[str, Any]) -> Placement:
        """Which workers a trial with ``params`` may reserve: those declaring the resources its
        trainers hold (a Trainer's ``resources=``); default: every worker."""
        return Placement()

    def prepare(self) -> None:
        """Work done once before the first trial (persisting data)."""

    @abstractmethod
    def run(self, ctx: TrialContext) -> Outcome:
        """Run one trial to its end (blocking, in a trial thread)."""

    def interrupt(self, ctx: TrialContext) -> None:
        """Ask a running trial to end now (the search is stopping); default: it watches
        ``ctx.stopping`` itself."""

    def close(self) -> None:
        """Release what :meth:`prepare` holds."""


class SearchStop(StopCondition):
    """Stops a trial's job when the search stops (checked on the controller's ticks)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def should_stop(self, record: Any, *, elapsed_s: float, step: int) -> bool:
        return self.event.is_set()

    def describe(self) -> str:
        return "search stopped"

    def __deepcopy__(self, memo: dict[int, Any]) -> SearchStop:
        return self  # the event is shared on purpose


class Pruned(StopCondition):
    """Stops a trial's job once the search's pruner decided so (``ctx.pruned``). Listed after
    the trial's own stop conditions: one of those firing at the same score is why the job
    stopped (the first that fires wins), and the trial is complete, not pruned."""

    def __init__(self, ctx: TrialContext) -> None:
        self.ctx = ctx

    def should_stop(self, record: Any, *, elapsed_s: float, step: int) -> bool:
        return self.ctx.pruned

    def describe(self) -> str:
        return PRUNED

    def __deepcopy__(self, memo: dict[int, Any]) -> Pruned:
        return self  # reads the trial's own context


#: The job's ``stopped_by`` when the pruner ended it.
PRUNED = "pruned"

#: Pruning steps count thousandths of a trial's planned training (samples of all its epochs,
#: or boosting rounds), so trials of different lengths and data sizes share one set of rungs.
STEPS = 1000


def progress_step(done: float, planned: float) -> int:
    """``done`` out of ``planned`` in thousandths (the pruner's step), at least 1.

    Examples
    --------
    >>> progress_step(250, 1000), progress_step(0, 1000), progress_step(5, 0)
    (250, 1, 1000)
    """
    if planned <= 0:
        return STEPS
    return max(1, min(STEPS, int(STEPS * done / planned)))


class ReportScores(Callback):
    """Sends each score of ``metric`` to the trial's ``report`` with the share of the planned
    samples (``planned``) seen so far. Stopping is the stop conditions' (:class:`Pruned`,
    :class:`SearchStop`): a callback's stop would read ``stopped_by="callback"`` and come a pass
    after the trial's own stop conditions, which must win a tie."""

    def __init__(self, ctx: TrialContext, metric: str, planned: float) -> None:
        self.ctx, self.metric, self.planned = ctx, metric, planned

    def on_score(self, record: Mapping[str, Any]) -> bool | None:
        value = record.get(self.metric)
        if isinstance(value, (int, float)) and not math.isnan(float(value)):
            self.ctx.report(float(value), progress_step(float(record.get("samples", 0)),
                                                        self.planned))
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> ReportScores:
        return self


def last_score(history: pd.DataFrame, metric: str) -> float:
    """The last recorded value of ``metric`` (NaN when it never was)."""
    if metric not in history or history[metric].dropna().empty:
        return math.nan
    return float(history[metric].dropna().iloc[-1])


def clock() -> float:
    """Seconds on a monotonic clock (trial durations)."""
    return time.monotonic()


def lost_worker(error: BaseException, gang: list[str], *, number: int,
                alive: Callable[[], Any]) -> str:
    """Why trial ``number`` failed with ``error`` when the cause was a lost worker of its
    ``gang``; "" when the trial failed by itself (its own code raised: a bad parameter, a
    shape error), which a retry would only repeat.

    A trial lost a worker when the error says so (:class:`~dask_train.WorkerLost`, Dask's
    ``KilledWorker``) or a worker of its gang left the cluster. Errors that Dask or XGBoost
    raise on a broken connection (a cancelled future, a failed all-reduce) may reach the client
    a moment before the scheduler has removed the dead worker, so for those the gang is looked
    at again for up to a second; a user's own exception is judged at once.
    """
    said = f"{type(error).__name__}: {error}"
    if isinstance(error, WorkerLost):
        return said
    deadline = clock() + (1.0 if _from_the_wire(error) else 0.0)
    while True:
        workers = alive()
        gone = [w for w in gang if w not in workers]
        if gone or clock() >= deadline:
            break
        time.sleep(0.1)
    if not gone and type(error).__name__ != "KilledWorker":
        return ""
    # Say what happened, not only Dask's symptom of it ("cancelled", "already forgotten").
    who = f"worker {gone[0]}" if gone else "a worker"
    return f"WorkerLost: {who} running trial {number} left the cluster ({said})"


def _from_the_wire(error: BaseException) -> bool:
    """Raised by Dask or XGBoost (a cancelled future, a closed comm, a failed collective)."""
    module = type(error).__module__ or ""
    return module.split(".")[0] in ("distributed", "xgboost", "tornado") or \
        isinstance(error, (ConnectionError, EOFError))
