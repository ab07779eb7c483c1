"""What ``dt.search`` returns: every trial's parameters, state, score and time; the best model."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from dask_train.errors import InvalidInput
from dask_train.tuning._plot import plot_search
from dask_train.tuning._records import TrialRecord, best_so_far


@dataclass
class SearchResult:
    """The outcome of :func:`dask_train.search`.

    Attributes
    ----------
    trials : pandas.DataFrame
        One row per trial that ran: ``number``, ``state`` (complete, pruned, failed,
        interrupted), ``score``, ``time_s`` (its duration), ``start_s`` and ``end_s`` (seconds
        since the search started), one column per searched parameter, ``workers``,
        ``stopped_by``, ``error`` and ``attempts`` (more than 1 when a run lost a worker and
        was retried: ``retries=``; the records' ``retried_after`` say why).
    best_params : dict
        The parameters of the best complete trial (fixed ones included).
    best_score : float
        Its score on the validation data (NaN when no trial completed).
    best_model : object
        Its trained model: a torch module or ArrayModel (Trainer trials), a fitted estimator.
    best_result : object
        Its full result: a :class:`~dask_train.FitResult` for Trainer trials, else the fitted
        estimator.
    metric, mode : str
        What was optimised and in which direction.
    stopped_by : str
        Why the search ended: ``"n_trials=16"``, a stop condition, ``"KeyboardInterrupt"``.
    wall_s : float
        Seconds from the start of the search to its end.
    study : optuna.Study
        The study that sampled the parameters (``study.trials`` has optuna's own records).

    Examples
    --------
    >>> search = dt.search(trainer, {"lr": dt.loguniform(1e-4, 1e-1)}, X, y,   # doctest: +SKIP
    ...                    validation=(Xv, yv), n_trials=8)
    >>> search.trials[["number", "state", "score", "lr"]]                      # doctest: +SKIP
    >>> search.best_params, search.best_score, search.time_to(0.95)            # doctest: +SKIP
    >>> search.plot("search.png")                                              # doctest: +SKIP
    """

    records: list[TrialRecord]
    metric: str
    mode: str
    stopped_by: str
    wall_s: float
    study: Any = None
    param_names: list[str] = field(default_factory=list)

    @property
    def trials(self) -> pd.DataFrame:
        """One row per trial that ran (see the class docstring), in trial order."""
        from dask_train.tuning._space import describe

        rows = []
        for r in sorted(self.records, key=lambda r: r.number):
            rows.append({"number": r.number, "state": r.state, "score": r.score,
                         "time_s": r.end_s - r.start_s, "start_s": r.start_s, "end_s": r.end_s,
                         **describe({k: r.params.get(k) for k in self.param_names}),
                         "workers": ",".join(r.workers), "stopped_by": r.stopped_by,
                         "error": r.error, "attempts": r.attempts})
        columns = ["number", "state", "score", "time_s", "start_s", "end_s", *self.param_names,
                   "workers", "stopped_by", "error", "attempts"]
        return pd.DataFrame(rows, columns=columns)

    def _best(self) -> TrialRecord | None:
        done = [r for r in self.records if r.state == "complete" and not math.isnan(r.score)]
        if not done:
            return None
        pick = max if self.mode == "max" else min
        return pick(done, key=lambda r: (r.score, -r.number) if self.mode == "max"
                    else (r.score, r.number))

    @property
    def best_params(self) -> dict[str, Any]:
        """The best complete trial's parameters ({} when none completed)."""
        best = self._best()
        return dict(best.params) if best is not None else {}

    @property
    def best_score(self) -> float:
        """The best complete trial's score (NaN when none completed)."""
        best = self._best()
        return best.score if best is not None else math.nan

    @property
    def best_model(self) -> Any:
        """The best complete trial's model (None when none completed)."""
        best = self._best()
        return best.model if best is not None else None

    @property
    def best_result(self) -> Any:
        """The best complete trial's full result (None when none completed)."""
        best = self._best()
        return best.result if best is not None else None

    @property
    def best_trial(self) -> int | None:
        """The number of the best complete trial."""
        best = self._best()
        return best.number if best is not None else None

    def best_so_far(self) -> pd.DataFrame:
        """``time_s`` (since the search started) and the best ``score`` any trial had reached by
        then, one row per score reported (pruned and interrupted trials' scores included: they
        were reached)."""
        return best_so_far(self.records, self.mode)

    def time_to(self, score: float) -> float:
        """Seconds from the start of the search until some trial first reached ``score`` (NaN
        if none did)."""
        curve = self.best_so_far()
        hit = curve[curve["score"] >= score] if self.mode == "max" else \
            curve[curve["score"] <= score]
        return float(hit["time_s"].iloc[0]) if len(hit) else math.nan

    def summary(self) -> dict[str, Any]:
        """The search in a few JSON-able numbers."""
        states = self.trials["state"].value_counts().to_dict() if self.records else {}
        return {"metric": self.metric, "mode": self.mode, "best_score": self.best_score,
                "best_params": {k: str(v) if not isinstance(v, (int, float, str, bool))
                                else v for k, v in self.best_params.items()},
                "best_trial": self.best_trial, "trials": len(self.records),
                "states": {str(k): int(v) for k, v in states.items()},
                "stopped_by": self.stopped_by, "wall_s": self.wall_s}

    def plot(self, path: str | os.PathLike[str] = "search.png") -> Path:
        """Each trial's scores against search time, and the best so far, into a PNG."""
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidInput([f"path={path!r} is invalid: pass a file name such as 'search.png'."])
        return plot_search(self.records, metric=self.metric, mode=self.mode,
                           best_score=self.best_score, path=Path(path))
