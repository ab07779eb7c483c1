"""Trials of ``xgboost.dask`` models: each a distributed XGBoost job on its own reserved workers.

``xgboost.dask`` trains on exactly the workers that hold the DaskDMatrix's partitions (it reads
``who_has`` of the parts and runs one training task on each, under a ``MultiLock`` of those
addresses). So a trial's gang is made by placing the data: the training blocks are spread over
the gang's workers (once per gang, then reused) and the evaluation set sits on the gang's first
worker, so no worker outside the gang takes part.

Scores and pruning: an XGBoost callback runs on every worker of the job; after each boosting round
rank 0 sends the round's evaluation metric to the client as a Dask event and reads the trial's
stop flag on its own worker (set by the client when the pruner or the search says stop). Ranks
must stop at the same round or the others would wait in the next all-reduce: rank 0 broadcasts its
decision through XGBoost's own collective, so every rank returns the same answer.
"""

from __future__ import annotations

import asyncio
import math
import operator
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import dask.array as da
import numpy as np
import pandas as pd
from distributed import Client, get_worker
from xgboost import collective
from xgboost.callback import TrainingCallback

from dask_train.data._blocks import persist_pairs
from dask_train.policy._scope import use_workers
from dask_train.runtime._calls import live_workers, run_on_live
from dask_train.runtime._compat import drop_topic_handler
from dask_train.runtime._plugin import worker_state
from dask_train.tuning._data import SearchData
from dask_train.tuning._estimator_trials import estimator_problems
from dask_train.tuning._space import Space
from dask_train.tuning._trial import Outcome, TrialContext, TrialRunner, clock, progress_step

_EVAL_NAME = "validation_0"


class RoundReporter(TrainingCallback):  # type: ignore[misc]
    """XGBoost callback: report each round's metric (rank 0) and stop every rank together."""

    def __init__(self, *, job: str, metric: str) -> None:
        super().__init__()
        self.job, self.metric = job, metric

    def after_iteration(self, model: Any, epoch: int, evals_log: Mapping[str, Any]) -> bool:
        stop = False
        if collective.get_rank() == 0:
            worker = get_worker()
            values = evals_log.get(_EVAL_NAME, {}).get(self.metric) or [math.nan]
            value = values[-1][0] if isinstance(values[-1], tuple) else values[-1]
            worker.log_event(self.job, {"round": epoch + 1, "value": float(value)})
            stop = worker_state(worker).job(self.job).stop.is_set()
        return bool(collective.broadcast(stop, 0))


def _set_stop(job: str, dask_worker: Any) -> None:
    worker_state(dask_worker).job(job).stop.set()


def _drop(job: str, dask_worker: Any) -> None:
    worker_state(dask_worker).drop(job)


class XGBoostTrials(TrialRunner):
    """Each trial: a clone of the ``xgboost.dask`` estimator fitted on its gang's data."""

    kind = "xgboost"

    def __init__(self, estimator: Any, space: Space, *, data: SearchData, metric: str,
                 client: Client, workers_per_trial: int | None) -> None:
        self.estimator, self.space, self.data, self.metric = estimator, space, data, metric
        self.client, self.workers_per_trial = client, workers_per_trial
        self.lock = threading.Lock()
        self.jobs: dict[int, tuple[str, list[str]]] = {}
        self.n_classes = 0

    def problems(self) -> list[str]:
        problems = estimator_problems(self.estimator, self.space)
        if not isinstance(self.metric, str):
            problems.append(f"metric={self.metric!r} is invalid for XGBoost trials: use "
                            "'accuracy', 'loss' or an XGBoost eval_metric name such as 'auc'.")
        return problems

    def workers_needed(self, params: Mapping[str, Any]) -> int:
        return self.workers_per_trial or 2

    def prepare(self) -> None:
        from sklearn.base import is_classifier

        if is_classifier(self.estimator):
            # On the search's client: the default one may be another cluster's.
            self.n_classes = int(self.client.compute(da.max(self.data.y)).result()) + 1

    def _eval_metric(self) -> tuple[str, Any]:
        """XGBoost's name of the search metric, and how to turn its value into the metric."""
        multi = self.n_classes > 2
        if self.metric == "accuracy":
            return ("merror" if multi else "error"), lambda v: 1.0 - v
        if self.metric == "loss":
            name = ("mlogloss" if multi else "logloss") if self.n_classes else "rmse"
            return name, lambda v: v
        return self.metric, lambda v: v

    # -- data on a gang -----------------------------------------------------------------------------
    def _gang_data(self, gang: list[str], cache: dict[Any, Any]) -> tuple[Any, ...]:
        """X, y, X_val, y_val as dask arrays whose blocks are already in memory on ``gang``.

        Their keys are the keys of futures computed where the blocks must be, so the
        ``client.persist`` inside ``xgboost.dask`` has nothing left to place: an alias task
        (``from_delayed``, ``concatenate``) would be placed by the scheduler's cost model, which
        for small blocks may pick a worker outside the gang, or put every block on one.
        """
        key = ("xgboost", frozenset(gang))
        with self.lock:
            held = cache.get(key)
            if held is not None and all(f.status in ("finished", "pending") for f in held[-1]):
                return held  # type: ignore[no-any-return]
            with use_workers(gang):
                pairs = self.client.sync(persist_pairs, self.client, self.data.X, self.data.y)
            holders = self.client.who_has(pairs)
            where = [sorted(holders.get(p.key, ()) or gang)[:1] for p in pairs]
            token = uuid.uuid4().hex[:8]
            X = self._in_memory(f"dt-xgb-X-{token}", pairs, 0, where, self.data.X)
            y = self._in_memory(f"dt-xgb-y-{token}", pairs, 1, where, self.data.y)
            # The evaluation rows too, a part on each worker of the gang (a worker without any
            # logs "empty DMatrix" at every trial).
            Xv_np, yv_np = self.data.validation
            cuts = np.linspace(0, len(Xv_np), len(gang) + 1).astype(int)
            val = [self.client.scatter((Xv_np[a:b], yv_np[a:b]), workers=[w], direct=True,
                                       hash=False)
                   for w, a, b in zip(gang, cuts[:-1], cuts[1:])]
            Xv = self._in_memory(f"dt-xgb-Xv-{token}", val, 0, [[w] for w in gang], Xv_np)
            yv = self._in_memory(f"dt-xgb-yv-{token}", val, 1, [[w] for w in gang], yv_np)
            futures = [*X[1], *y[1], *Xv[1], *yv[1]]
            held = (X[0], y[0], Xv[0], yv[0], futures)
            cache[key] = held
            return held

    def _in_memory(self, name: str, pairs: list[Any], index: int, where: list[list[str]],
                   like: Any) -> tuple[da.Array, list[Any]]:
        """A dask array named ``name`` whose block ``i`` is part ``index`` of ``pairs[i]``,
        computed on ``where[i]`` under the array's own key (what ``client.persist`` returns)."""
        from dask.highlevelgraph import HighLevelGraph

        futures = [self.client.submit(operator.getitem, pair, index, key=(name, i, *[0] * (
            like.ndim - 1)), workers=w, allow_other_workers=True, pure=False)
            for i, (pair, w) in enumerate(zip(pairs, where))]
        # Waits until every block is computed in place; one small answer per block.
        rows = tuple(int(n) for n in self.client.gather(
            self.client.map(len, futures, pure=False)))
        chunks = (rows, *((int(s),) for s in like.shape[1:]))
        graph = HighLevelGraph.from_collections(name, {f.key: f for f in futures},
                                                dependencies=())
        return da.Array(graph, name, chunks, dtype=like.dtype), futures

    # -- one trial ----------------------------------------------------------------------------------
    def run(self, ctx: TrialContext) -> Outcome:
        from sklearn.base import clone

        X, y, Xv, yv, _ = self._gang_data(ctx.gang, ctx.cache)
        job = f"dt-xgb-{ctx.number}-{uuid.uuid4().hex[:8]}"
        name, to_metric = self._eval_metric()
        estimator = clone(self.estimator).set_params(**ctx.params)
        callbacks = list(estimator.get_params().get("callbacks") or [])
        settings: dict[str, Any] = {"callbacks": [*callbacks, RoundReporter(job=job, metric=name)],
                                    "eval_metric": name}
        estimator.set_params(**settings)
        estimator.client = self.client
        rounds_planned = int(estimator.get_params().get("n_estimators") or 100)
        self.jobs[ctx.number] = (job, ctx.gang)
        stopping = {"sent": False}

        def on_round(event: Any) -> None:  # on the client's event loop
            msg = event[1]
            step = progress_step(int(msg["round"]), rounds_planned)
            if ctx.report(to_metric(float(msg["value"])), step) and not stopping["sent"]:
                stopping["sent"] = True
                asyncio.ensure_future(run_on_live(self.client, _set_stop, job, workers=ctx.gang))

        started = clock()
        self.client.subscribe_topic(job, on_round)
        try:
            estimator.fit(X, y, eval_set=[(Xv, yv)], verbose=False)
        finally:
            self.client.unsubscribe_topic(job)
            drop_topic_handler(self.client, job)
            self.jobs.pop(ctx.number, None)
            alive = set(live_workers(self.client))
            live = [w for w in ctx.gang if w in alive]
            if live:
                self.client.run(_drop, job, workers=live, on_error="ignore")
        log = estimator.evals_result().get(_EVAL_NAME, {}).get(name, [])
        values = [to_metric(float(v)) for v in log]
        history = pd.DataFrame({"time_s": np.full(len(values), clock() - started),
                                "round": np.arange(1, len(values) + 1), "score": values})
        rounds = len(values)
        return Outcome(score=values[-1] if values else math.nan, model=estimator, history=history,
                       stopped_by=f"rounds={rounds}", result=estimator, info={"rounds": rounds},
                       pruned=ctx.pruned and rounds < rounds_planned)

    def interrupt(self, ctx: TrialContext) -> None:
        job_gang = self.jobs.get(ctx.number)
        if job_gang is not None:
            alive = set(live_workers(self.client))
            live = [w for w in job_gang[1] if w in alive]
            if live:
                self.client.run(_set_stop, job_gang[0], workers=live, on_error="ignore")
