"""``Trainer.fit`` for a numpy ``ArrayModel``: its blocks persisted, the numpy sync engine
(``engines.array``) under the one controller, from the fit's plan."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from distributed import Client

from dask_train.api._build import fit_result, job_spec, param_count
from dask_train.api._fit import check_plan
from dask_train.api._plan import Choice, FitPlan
from dask_train.api._result import FitResult
from dask_train.controller._controller import Controller
from dask_train.controller._progress import Progress
from dask_train.data._training import TrainingData
from dask_train.engines._registry import ENGINES
from dask_train.policy._placement import Roles
from dask_train.policy.callbacks import run_callbacks


def fit_array(plan: FitPlan, data: TrainingData, validation: Any, *, resume: bool, start: Any,
              mode: str, client: Callable[[], Client]) -> FitResult:
    """One fit of an ArrayModel: the numpy sync engine under the same controller; ``start`` is
    the model it starts from, ``client()`` the cluster (called once the arguments are
    checked)."""
    from dask_train.data import persist_data

    check_plan(plan, data, validation, resume=resume, mode=mode)
    cluster = client()
    # numpy has one engine, synchronous: strategy="auto" is it too.
    from dask_train.runtime._roles import worker_threads

    plan = plan.chose(Choice("sync", plan.settings.cluster.trainers(len(worker_threads(cluster))),
                             0, {"strategy": "sync"}))
    X, y = data.X, data.y
    t = time.time()
    persisted = persist_data(X, y, client=cluster, dtype=np.float64)
    plan.took("persist", t)
    spec = job_spec(plan, start=start, n_params=param_count(plan.model))
    held = {"data": persisted}
    engine_cls = ENGINES["array"].engine_class()

    def make_engine(roles: Roles, job: str, restore: Any) -> Any:
        if any(f.status != "finished" for f in held["data"].futures):
            # A lost worker took blocks that Dask cannot recompute (scattered numpy input):
            # persist them again, from the collection the user passed.
            held["data"].release()
            held["data"] = persist_data(X, y, client=cluster, dtype=np.float64)
        return engine_cls(cluster, spec, held["data"], validation, job=job, restore=restore)

    first = make_engine(Roles(), "probe", None).roles  # where the groups and scorer will run
    try:
        run_callbacks(spec.callbacks, "on_fit_start", {"roles": first, "rows": persisted.n_rows,
                                                       "params": plan.tracked_params()})
        with Progress(total=spec.epochs * persisted.n_rows, enabled=spec.progress) as progress:
            started = time.time()
            controller = Controller(cluster, spec, make_engine=make_engine,
                                    plan_roles=lambda alive: Roles(), roles=first,
                                    rows=persisted.n_rows, progress=progress)
            outcome = controller.run_sync(resume=resume)
            progress.close(outcome.stopped_by)
    finally:
        held["data"].release()
    result = fit_result(plan, outcome, wall_s=time.time() - started)
    run_callbacks(spec.callbacks, "on_fit_end", result)
    return result
