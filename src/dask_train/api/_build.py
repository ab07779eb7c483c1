"""What a fit builds from its plan: the job spec, the roles, the trained model and the
``FitResult``. Each takes the fit's :class:`~dask_train.api._plan.FitPlan`, never the Trainer."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dask_train.api._job_result import job_fields
from dask_train.api._job_spec import build_spec
from dask_train.api._plan import FitPlan
from dask_train.api._result import FitResult, scorer_record
from dask_train.controller._controller import Outcome
from dask_train.engines._registry import engine_entry
from dask_train.engines._spec import JobSpec, TrainSettings
from dask_train.errors import InvalidInput
from dask_train.models._array import ArrayModel
from dask_train.models._frameworks import is_keras_model
from dask_train.models._torch import flatten_parameters
from dask_train.models._transport import travelling
from dask_train.policy._placement import Roles, plan_roles

if TYPE_CHECKING:
    from dask_train.runtime._devices import Devices


def float_dtype(module: Any) -> Any:
    """The numpy dtype of a model's floating parameters (float32 unless it says otherwise)."""
    if is_keras_model(module):
        from dask_train.models._frameworks import keras_float_dtype

        return keras_float_dtype(module)
    params = [p for p in module.parameters() if p.is_floating_point()]
    return np.dtype(str(params[0].dtype).removeprefix("torch.")) if params else np.float32


def job_spec(plan: FitPlan, *, start: Any, devices: Devices | None = None,
             n_params: int | None = None, data_note: str = "") -> JobSpec:
    """The engines' view of a fit's plan, built once: ``start`` is the model the job starts
    from (a copy: the user's is never modified), ``devices`` the probed
    :class:`~dask_train.runtime._devices.Devices` (None: the CPU), ``data_note`` how the
    training data reaches the trainers, for the Training page."""
    s = plan.settings
    m, scoring = s.model, s.scoring
    if n_params is None:
        n_params = param_count(plan.model)
    trainers = plan.trainers
    train = TrainSettings(
        module=travelling(start, factory=plan.factory), n_params=n_params, loss=m.loss,
        optim=m.optim(), prefetch=m.prefetch_count(), grad_accumulation=int(m.grad_accumulation),
        ps=plan.servers, scorer=int(scoring.scorer), score_every=float(scoring.score_every),
        scorer_budget=scoring.budget(trainers), metrics=dict(m.metrics) if m.metrics else None)
    return build_spec(s, strategy=engine_entry(plan.engine).strategy, workers=trainers,
                      most_workers=s.cluster.most(), batch_size=plan.per_trainer_batch(),
                      epochs=int(s.data.epochs or 1), devices=devices, train=train,
                      progress=bool(s.progress), data_note=data_note)


def param_count(model: Any) -> int:
    """The model's parameters, as the holders keep them (flat)."""
    if isinstance(model, ArrayModel):
        return int(model.params.size)
    if is_keras_model(model):
        from dask_train.models._frameworks import keras_param_count

        return int(keras_param_count(model))
    return int(flatten_parameters(model).numel())


def fit_roles(plan: FitPlan, client: Any, *, has_validation: bool) -> Roles:
    """Where a torch fit's roles start, on ``client``'s workers."""
    from dask_train.runtime._roles import ensure_plugin, worker_threads

    ensure_plugin(client)
    threads = worker_threads(client)
    cluster = plan.settings.cluster
    if engine_entry(plan.engine).one_rank_per_worker and plan.trainers > len(threads):
        # torch's default process group is one per process: one rank per Dask worker.
        workers = cluster.workers
        raise InvalidInput([
            f"workers={workers} needs at least {plan.trainers} Dask workers and the cluster "
            f"has {len(threads)}: strategy={plan.strategy!r} runs one rank per worker process; "
            "lower the least or add workers." if cluster.ranged else
            f"workers={workers} is more than the {len(threads)} Dask "
            f"workers of the cluster: strategy={plan.strategy!r} runs one rank per worker "
            "process; lower workers= or add workers."
        ])
    return replan_roles(plan, has_validation, client)(threads, cap=False)


def check_trainer_room(plan: FitPlan, client: Any) -> None:
    """Refuse a fit with ``resources=`` whose trainers cannot all be placed, before its data is
    put on the workers (see :func:`~dask_train.runtime._roles.check_room`): its least trainers,
    one a worker for a strategy of ranks."""
    from dask_train.runtime._roles import check_room

    cluster = plan.settings.cluster
    if not cluster.placement:
        return
    strategy = str(plan.settings.strategy)
    one_rank = strategy != "auto" and engine_entry(strategy).one_rank_per_worker
    check_room(client, cluster.placement, need=plan.trainers, what=f"workers={cluster.workers!r}",
               one_per_worker=one_rank)


def replan_roles(plan: FitPlan, has_validation: bool, client: Any) -> Any:
    """The placement of a generation on the live workers: ``plan(alive)``. An engine of one
    rank per worker takes as many ranks as there are workers left, up to its own (``cap``).
    With ``resources=``, trainers go only to the workers that declare them (as many on each as
    its resources hold, one for a rank); servers and the scorer anywhere."""
    from dask_train.data._cluster import declared_resources

    entry = engine_entry(plan.engine)
    scorer = int(plan.settings.scoring.scorer) if has_validation else 0
    cluster = plan.settings.cluster
    placement = cluster.placement

    def place(alive: Mapping[str, int], cap: bool = True) -> Roles:
        declared = {a: declared_resources(client).get(a, {}) for a in alive}
        slots = placement.slots(declared) if placement else None
        if slots is not None and entry.one_rank_per_worker:
            slots = {a: 1 for a in slots}
        room = len(alive) if slots is None else sum(slots.values())
        workers = plan.trainers
        if cluster.ranged:
            # As many as there are workers within (least, most): joiners bring it up to most.
            workers = cluster.trainers(room)
            if (entry.one_rank_per_worker or slots is not None) and workers > room:
                raise InvalidInput([
                    placement.too_few(need=workers, declared=declared,
                                      what=f"workers={cluster.workers!r}") if slots is not None
                    else f"workers={cluster.workers!r}: only {len(alive)} Dask workers are "
                         f"left, fewer than the {workers} the job needs; add workers or lower "
                         "the least."])
        if (entry.one_rank_per_worker or slots is not None) and cap:
            # A restart on fewer workers than it had: fewer ranks (trainers), none sharing.
            workers = min(workers, room)
        if slots is not None and not 0 < workers <= room:
            raise InvalidInput([placement.too_few(need=max(workers, 1), declared=declared,
                                                  what=f"workers={cluster.workers!r}")])
        return Roles(plan_roles(alive, ps=plan.servers if entry.servers else 0, worker=workers,
                                scorer=scorer, slots=slots))

    return place


def prepare_keras(client: Any, roles: Roles, *, timeout: float) -> None:
    """Ready the roles' workers for a Keras model (TensorFlow imported, serialization fixed)."""
    from dask_train.models._keras import warm_workers
    from dask_train.runtime._compat import fix_keras_serialization

    fix_keras_serialization()  # distributed's Keras serializer is for Keras 2
    warm_workers(client, roles.addresses, timeout=timeout)


def trained_model(module: Any, params: Any, buffers: Any = None) -> Any:
    """A copy of the user's model holding ``params`` and ``buffers`` (running statistics),
    never the user's object itself."""
    if isinstance(module, ArrayModel):
        return dataclasses.replace(module, params=np.array(params, dtype=np.float64))
    if is_keras_model(module):
        from dask_train.models._keras import KerasFlatModel

        model = copy.deepcopy(module)
        adapter = KerasFlatModel(model)
        adapter.set_flat(params)
        adapter.buffers().scatter(buffers)
        return model
    from dask_train.models._buffers import BufferSet
    from dask_train.models._flat import FlatModel

    model = copy.deepcopy(module)
    flat = FlatModel(model)
    flat.set_flat(params)
    # Detach the parameters from the shared flat buffer so the result is an ordinary module.
    for p in flat.params:
        p.data = p.data.clone()
    BufferSet(model).scatter(buffers)
    return model


def fit_result(plan: FitPlan, outcome: Outcome, *, wall_s: float) -> FitResult:
    """The ``FitResult`` of a fit that ran ``outcome``."""
    final = outcome.ending.final or {}
    return FitResult(
        model=trained_model(plan.model, outcome.ending.params, outcome.ending.buffers),
        **job_fields(outcome, wall_s=wall_s, clock=plan.clock),
        trainers=outcome.ending.trainers, nonfinite=list(outcome.log.nonfinite),
        model_step=outcome.model_step,
        validation_rows=dict(final.get("validation_rows") or {}),
        plan=dict(plan.choice.record) if plan.choice is not None else {},
        scorer=scorer_record(final.get("cpu"), wall_s=wall_s),
    )
