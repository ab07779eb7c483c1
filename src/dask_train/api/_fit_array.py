"""``Trainer.fit`` for a numpy ``ArrayModel``: its blocks persisted, the numpy sync engine
(``engines.array``) under the one controller. Kept out of the Trainer's module, which holds the
user's entry points."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from dask_train.api._auto_strategy import FitPlan
from dask_train.api._result import FitResult
from dask_train.controller._controller import Controller
from dask_train.controller._progress import Progress
from dask_train.models._array import ArrayModel
from dask_train.policy._placement import Roles
from dask_train.policy.callbacks import run_callbacks


def fit_array(trainer: Any, X: Any, y: Any, validation: Any, *, resume: bool,
              warm_start: bool = False, sample_weight: Any = None,
              mode: str = "auto") -> FitResult:
    """``Trainer.fit`` (of ``trainer``) for an ArrayModel: the numpy sync engine under the same
    controller."""
    from dask_train.data import persist_data
    from dask_train.engines.array.engine import ArrayEngine

    trainer._validate(X, y, validation, resume=resume, sample_weight=sample_weight,
                   data=(mode, False))
    assert isinstance(trainer._model(), ArrayModel)
    client = trainer._client()
    trainer._plan = FitPlan("sync", int(trainer.workers), 0, {"strategy": "sync"})  # numpy: sync
    t = time.time()
    data = persist_data(X, y, client=client, dtype=np.float64)
    trainer._clock["persist"] += time.time() - t
    spec = trainer._spec(n_params=int(trainer._model().params.size),
                      module=trainer._start_model(warm_start))
    held = {"data": data}

    def make_engine(roles: Roles, job: str, restore: Any) -> Any:
        if any(f.status != "finished" for f in held["data"].futures):
            # A lost worker took blocks that Dask cannot recompute (scattered numpy input):
            # persist them again, from the collection the user passed.
            held["data"].release()
            held["data"] = persist_data(X, y, client=client, dtype=np.float64)
        return ArrayEngine(client, spec, held["data"], validation, job=job, restore=restore)

    first = make_engine(Roles(), "probe", None).roles  # where the groups and scorer will run
    try:
        run_callbacks(trainer.callbacks, "on_fit_start", {"roles": first, "rows": data.n_rows,
                                                       "params": trainer._tracked_params()})
        with Progress(total=trainer.epochs * data.n_rows, enabled=trainer.progress) as progress:
            started = time.time()
            controller = Controller(client, spec, make_engine=make_engine,
                                    plan_roles=lambda alive: Roles(), roles=first,
                                    rows=data.n_rows, progress=progress)
            outcome = controller.run_sync(resume=resume)
            progress.close(outcome.stopped_by)
    finally:
        held["data"].release()
    result = trainer._result(outcome, wall_s=time.time() - started)
    trainer._last_model = result.model
    run_callbacks(trainer.callbacks, "on_fit_end", result)
    return result

