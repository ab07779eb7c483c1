"""Trials of scikit-learn-style estimators: one worker each, many at once.

Two ways, by what the estimator needs:

* any estimator (scikit-learn's, ``xgboost.XGBClassifier``, ...): one task on the trial's worker
  fits a clone on the training data held in that worker's memory (gathered there once per worker
  and kept for the whole search) and scores it on the validation data;
* dask-train's GLMs (``dt.LogisticRegression``, ...), which fit through a client: the fit is driven
  from the trial's client thread with its blocks and tasks on the trial's worker(s) only
  (:func:`~dask_train.policy._scope.use_workers`).

Neither reports scores while fitting, so neither is pruned; both score once at the end.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import dask
import numpy as np
import pandas as pd
from distributed import Client, Future

from dask_train.errors import WorkerLost
from dask_train.policy._scope import use_workers
from dask_train.runtime._calls import live_workers
from dask_train.tuning._data import Resendable, SearchData, on_cluster
from dask_train.tuning._space import Space, check_names
from dask_train.tuning._trial import Outcome, TrialContext, TrialRunner, clock

Scorer = Callable[[Any, Any, Any], float]


def make_scorer(metric: Any) -> Scorer:
    """``scorer(estimator, X, y) -> float``: a scikit-learn scorer name (``"accuracy"``,
    ``"neg_log_loss"``, ``"r2"``...) or a function ``fn(y_true, y_pred)``."""
    if callable(metric):
        return lambda est, X, y: float(metric(y, est.predict(X)))
    from sklearn.metrics import get_scorer

    scorer = get_scorer(metric)
    return lambda est, X, y: float(scorer(est, X, y))


def metric_problems(metric: Any) -> list[str]:
    """A problem when ``metric`` is neither a scikit-learn scorer name nor a function."""
    if callable(metric):
        return []
    from sklearn.metrics import get_scorer_names

    if metric not in get_scorer_names():
        return [f"metric={metric!r} is not a scikit-learn scorer: use one of 'accuracy', "
                "'balanced_accuracy', 'f1', 'roc_auc', 'neg_log_loss', 'r2', "
                "'neg_mean_squared_error' (sklearn.metrics.get_scorer_names()) or a function "
                "fn(y_true, y_pred)."]
    return []


def estimator_problems(estimator: Any, space: Space) -> list[str]:
    """Problems with a scikit-learn-style estimator and the space's names."""
    if not all(callable(getattr(estimator, m, None)) for m in ("get_params", "set_params", "fit")):
        return [f"model={type(estimator).__name__} is not searchable: pass a dt.Trainer or an "
                "estimator with get_params, set_params and fit (scikit-learn's API)."]
    known = list(estimator.get_params(deep=True))
    return check_names(space, known, owner=type(estimator).__name__)


def _stack(xs: list[np.ndarray], ys: list[np.ndarray], worker: str) -> tuple[np.ndarray, np.ndarray]:
    """The training data as two in-memory arrays (``worker`` only makes the key per worker)."""
    return np.concatenate(xs), np.concatenate(ys)


def fit_and_score(estimator: Any, data: tuple[np.ndarray, np.ndarray],
                  validation: tuple[np.ndarray, np.ndarray], metric: Any) -> tuple[Any, float, float]:
    """Dask task: fit ``estimator`` on ``data`` here; (fitted estimator, score, fit seconds)."""
    started = time.perf_counter()
    estimator.fit(*data)
    fit_s = time.perf_counter() - started
    return estimator, make_scorer(metric)(estimator, *validation), fit_s


class EstimatorTrials(TrialRunner):
    """One task per trial on one worker; the data is gathered into each worker's memory once."""

    kind = "estimator"

    def __init__(self, estimator: Any, space: Space, *, data: SearchData, metric: Any,
                 client: Client, workers_per_trial: int | None = None) -> None:
        self.estimator, self.space, self.data, self.metric = estimator, space, data, metric
        self.client, self.workers_per_trial = client, workers_per_trial
        self.local: dict[str, Future] = {}
        self.validation: Resendable | None = None
        self.lock = threading.Lock()

    def problems(self) -> list[str]:
        problems = estimator_problems(self.estimator, self.space) + metric_problems(self.metric)
        if self.workers_per_trial not in (None, 1):
            problems.append(f"workers_per_trial={self.workers_per_trial} is invalid for a "
                            f"{type(self.estimator).__name__}: it fits in one worker; leave "
                            "workers_per_trial out.")
        return problems

    def workers_needed(self, params: Mapping[str, Any]) -> int:
        return 1

    def prepare(self) -> None:
        self.validation = on_cluster(self.client, self.data.validation)

    def _data_on(self, worker: str) -> Future:
        with self.lock:
            fut = self.local.get(worker)
            if fut is None or fut.status in ("error", "cancelled", "lost"):
                xs = self.data.X.to_delayed().ravel().tolist()
                ys = self.data.y.to_delayed().ravel().tolist()
                # Loose restriction: if that worker dies, Dask may rebuild it elsewhere.
                fut = self.client.compute(dask.delayed(_stack, pure=True)(xs, ys, worker),
                                          workers=[worker], allow_other_workers=True)
                self.local[worker] = fut
            return fut

    def run(self, ctx: TrialContext) -> Outcome:
        from sklearn.base import clone

        [worker] = ctx.gang
        estimator = clone(self.estimator).set_params(**ctx.params)
        started = clock()
        assert self.validation is not None, "prepare() runs before the trials"
        fut = self.client.submit(fit_and_score, estimator, self._data_on(worker),
                                 self.validation.future(),
                                 self.metric, workers=[worker], allow_other_workers=False,
                                 pure=False, key=f"dt-trial-{ctx.number}-{uuid.uuid4().hex[:8]}")
        try:
            watch(self.client, fut, worker=worker, ctx=ctx)
            fitted, score, fit_s = fut.result()
        finally:
            fut.release()
        history = pd.DataFrame({"time_s": [clock() - started], "score": [score]})
        return Outcome(score=score, model=fitted, history=history, stopped_by="fit",
                       result=fitted, info={"fit_s": fit_s})

    def close(self) -> None:
        self.local.clear()
        self.validation = None


class Interrupted(Exception):
    """The search stopped while the trial ran (Ctrl-C or a search stop condition)."""


def watch(client: Client, fut: Future, *, worker: str, ctx: TrialContext) -> None:
    """Wait for a trial's task; cancel it when the search stops or its worker leaves.

    A task pinned to a worker that left would wait in ``no-worker`` forever: the liveness check
    turns that into a failed trial within a second.
    """
    next_check = 0.0
    while fut.status == "pending":
        if ctx.stopping.wait(0.1):
            fut.cancel()
            raise Interrupted("the search stopped")
        if clock() >= next_check:
            next_check = clock() + 1.0
            if worker not in live_workers(client):
                fut.cancel()
                raise WorkerLost(f"worker {worker} running trial {ctx.number} left the cluster",
                                 worker=worker, role=f"trial-{ctx.number}")


class GLMTrials(TrialRunner):
    """dask-train's GLMs: each trial's fit driven from its thread on its own worker(s)."""

    kind = "glm"

    def __init__(self, estimator: Any, space: Space, *, data: SearchData, metric: Any,
                 client: Client, workers_per_trial: int | None) -> None:
        self.estimator, self.space, self.data, self.metric = estimator, space, data, metric
        self.client, self.workers_per_trial = client, workers_per_trial

    def problems(self) -> list[str]:
        return estimator_problems(self.estimator, self.space) + metric_problems(self.metric)

    def workers_needed(self, params: Mapping[str, Any]) -> int:
        return self.workers_per_trial or 1

    def run(self, ctx: TrialContext) -> Outcome:
        from sklearn.base import clone

        estimator = clone(self.estimator).set_params(**ctx.params)
        estimator.client = self.client
        started = clock()
        with use_workers(ctx.gang):
            estimator.fit(self.data.X, self.data.y)
        score = make_scorer(self.metric)(estimator, *self.data.validation)
        history = pd.DataFrame({"time_s": [clock() - started], "score": [score]})
        return Outcome(score=score, model=estimator, history=history,
                       stopped_by=f"n_iter_={getattr(estimator, 'n_iter_', '?')}", result=estimator)
