"""One ``Trainer.fit`` of a torch or Keras model, from its plan: checked, its strategy chosen,
its data on the workers, its roles placed, run by the one controller.

Every step takes the fit's :class:`~dask_train.api._plan.FitPlan` and its
:class:`~dask_train.data._training.TrainingData`, built once by the Trainer; the numpy
``ArrayModel``'s fit is :mod:`dask_train.api._fit_array`. Both end in the one run of every job
(:func:`~dask_train.api._drive.drive`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from distributed import Client

from dask_train.api._auto_strategy import choose
from dask_train.api._build import (
    check_trainer_room,
    fit_result,
    fit_roles,
    float_dtype,
    job_spec,
    prepare_keras,
    replan_roles,
)
from dask_train.api._data import materialize, spread_validation
from dask_train.api._drive import drive
from dask_train.api._plan import FitPlan
from dask_train.api._result import FitResult
from dask_train.api._validate import check_fit, check_label_range
from dask_train.controller._interrupt import interrupted_early
from dask_train.data._training import TrainingData
from dask_train.engines._registry import engine_entry
from dask_train.errors import InvalidInput
from dask_train.models._array import ArrayModel
from dask_train.models._frameworks import is_keras_model, keras_sparse_labels
from dask_train.models._torch import is_classification
from dask_train.policy._data_mode import check_data_mode
from dask_train.policy._placement import Roles

logger = logging.getLogger("dask_train.api._trainer")


def check_plan(plan: FitPlan, data: TrainingData, validation: Any, *, resume: bool,
               mode: str, typed: TrainingData | None = None) -> None:
    """Every problem with a fit of ``plan`` on ``data`` at once, before any work; ``typed``:
    ``data`` cast to the model's float dtype (cast here when not given).

    Raises
    ------
    InvalidInput
        Listing them all.
    """
    s, model = plan.settings, plan.model
    array = isinstance(model, ArrayModel)
    cast = data if array else typed or data.cast(float_dtype(model))
    problems = check_fit(s, data.X, data.y, validation, resume=resume,
                         sample_weight=data.weights, typed=lambda: cast.X, factory=plan.factory)
    problems += check_data_mode(mode, in_memory=data.in_memory and not array, full_batch=array)
    if array and s.cluster.resources:
        # The numpy engine places its groups on every worker itself (engines.array).
        problems.append(f"resources={s.cluster.resources!r} applies to the trainers of torch and "
                        "Keras models; an ArrayModel's groups run on every worker: leave it out.")
    if problems:
        raise InvalidInput(problems)


def fit_torch(plan: FitPlan, data: TrainingData, validation: Any, *, resume: bool, start: Any,
              mode: str, client: Callable[[], Client]) -> FitResult:
    """Run one fit of a torch or Keras model; ``start`` is the model it starts from (a copy),
    ``client()`` the cluster (called once the arguments are checked)."""
    # A dask validation set stays on the cluster, scored where its blocks live.
    dtype = float_dtype(plan.model)
    validation = materialize(validation, dtype=dtype, keep_dask=True)
    # X cast once: the checks, the strategy's choice and the blocks all read this one.
    typed = data.cast(dtype)
    check_plan(plan, data, validation, resume=resume, mode=mode, typed=typed)
    if typed is not data:
        logger.info("X is %s and the module's parameters are %s: X is converted to %s",
                    data.X.dtype, dtype, typed.X.dtype)
    cluster = client()
    check_trainer_room(plan, cluster)
    t = time.time()
    spread = spread_validation(cluster, validation)
    plan.took("persist", t)
    try:
        return _run(plan, cluster, typed, spread or validation, resume=resume, start=start,
                    mode=mode)
    except KeyboardInterrupt as exc:  # before the controller ran: one line, no traceback
        raise interrupted_early(exc) from None
    finally:
        if spread is not None:
            spread.release()


def _run(plan: FitPlan, client: Client, data: TrainingData, validation: Any, *, resume: bool,
         start: Any, mode: str) -> FitResult:
    """The fit on the cluster; ``data`` already cast to the model's float dtype."""
    from dask_train.runtime._devices import probe_devices
    from dask_train.runtime._roles import trainer_workers

    s = plan.settings
    keras = is_keras_model(plan.model)  # TensorFlow places its math: no torch devices
    devices = probe_devices(client, "cpu" if keras else s.cluster.device,
                            mixed_precision=s.cluster.mixed_precision,
                            workers=trainer_workers(client, s.cluster.placement)
                            if s.cluster.placement else None)
    plan = plan.chose(choose(plan, client, data.X, data.y, device_kind=devices.kind))
    if devices.kind == "cuda" or devices.precision:
        logger.info("training on %s (%s)%s", devices.kind, devices.by_worker or "",
                    f", autocast {devices.precision}" if devices.precision else "")
    t = time.time()
    loss = s.model.loss
    labels = is_classification(loss) or keras_sparse_labels(loss)
    blocks = data.blocks(client, mode=mode, labels=labels, timeout=float(s.cluster.timeout))
    spec = job_spec(plan, start=start, devices=devices, data_note=blocks.note)
    plan.took("persist", t)
    problems = check_label_range(plan.model, loss, data.X, blocks.label_range) if labels else []
    if problems:
        raise InvalidInput(problems)
    # First: importing the engine's module registers its worker-side RPC handlers.
    engine_cls = engine_entry(plan.engine).engine_class()
    roles = fit_roles(plan, client, has_validation=validation is not None)
    if keras:
        prepare_keras(client, roles, timeout=spec.timeout)

    def make_engine(roles: Roles, job: str, restore: Any) -> Any:
        return engine_cls(client, spec, roles, blocks, validation, job=job, restore=restore)

    return drive(client, spec, make_engine=make_engine,
                 plan_roles=replan_roles(plan, validation is not None, client), roles=roles,
                 rows=blocks.n_rows, params=plan.tracked_params(), resume=resume,
                 result=lambda outcome, wall_s: fit_result(plan, outcome, wall_s=wall_s))
