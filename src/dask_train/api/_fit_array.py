"""``Trainer.fit`` for a numpy ``ArrayModel``: its blocks persisted, numpy's one engine
(``"array"`` in the registry, ``engines.array``) under the one controller, from the fit's plan."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from distributed import Client

from dask_train.api._build import fit_result, job_spec, param_count
from dask_train.api._drive import drive
from dask_train.api._fit import check_plan
from dask_train.api._plan import Choice, FitPlan
from dask_train.api._result import FitResult
from dask_train.data._training import TrainingData
from dask_train.engines._registry import engine_entry
from dask_train.policy._placement import Roles


def fit_array(plan: FitPlan, data: TrainingData, validation: Any, *, resume: bool, start: Any,
              mode: str, client: Callable[[], Client]) -> FitResult:
    """One fit of an ArrayModel: the numpy engine under the same controller; ``start`` is
    the model it starts from, ``client()`` the cluster (called once the arguments are
    checked)."""
    from dask_train.data import persist_data

    check_plan(plan, data, validation, resume=resume, mode=mode)
    cluster = client()
    # numpy has one engine, synchronous: strategy="auto" is it too, and the fit reports
    # strategy="sync", as the user asked for it (plan.engine is "array").
    from dask_train.runtime._roles import worker_threads

    plan = plan.chose(Choice("sync", plan.settings.cluster.trainers(len(worker_threads(cluster))),
                             0, {"strategy": "sync"}))
    X, y = data.X, data.y
    t = time.time()
    persisted = persist_data(X, y, client=cluster, dtype=np.float64)
    plan.took("persist", t)
    spec = job_spec(plan, start=start, n_params=param_count(plan.model))
    held = {"data": persisted}
    engine_cls = engine_entry(plan.engine).engine_class()

    def make_engine(roles: Roles, job: str, restore: Any) -> Any:
        if any(f.status != "finished" for f in held["data"].futures):
            # A lost worker took blocks that Dask cannot recompute (scattered numpy input):
            # persist them again, from the collection the user passed.
            held["data"].release()
            held["data"] = persist_data(X, y, client=cluster, dtype=np.float64)
        return engine_cls(cluster, spec, held["data"], validation, job=job, restore=restore)

    try:
        first = make_engine(Roles(), "probe", None).roles  # where the groups and scorer will run
    except BaseException:
        held["data"].release()
        raise
    # The engine places its groups where the blocks are: a new generation re-places nothing.
    return drive(cluster, spec, make_engine=make_engine, plan_roles=lambda alive: Roles(),
                 roles=first, rows=persisted.n_rows, params=plan.tracked_params(),
                 resume=resume, release=lambda: held["data"].release(),
                 result=lambda outcome, wall_s: fit_result(plan, outcome, wall_s=wall_s))
