"""What a ``Trainer`` fit is built from and what it builds: the job spec, the engine class, the
trained model and the ``FitResult``. Functions of a Trainer's settings, kept out of the Trainer
so that it holds the user's entry points only."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from dask_train.api._model import is_factory
from dask_train.api._result import FitResult, phase_timings, scorer_record
from dask_train.controller._controller import Outcome
from dask_train.engines._spec import JobSpec
from dask_train.errors import InvalidInput
from dask_train.models._array import ArrayModel
from dask_train.models._frameworks import is_keras_model
from dask_train.models._torch import flatten_parameters
from dask_train.models._transport import travelling
from dask_train.policy._data_mode import read_ahead
from dask_train.policy._failure import FailureConfig
from dask_train.policy._placement import Roles, plan_roles
from dask_train.report import history_frame, ledger_frame


def float_dtype(module: Any) -> Any:
    """The numpy dtype of a model's floating parameters (float32 unless it says otherwise)."""
    if is_keras_model(module):
        from dask_train.models._frameworks import keras_float_dtype

        return keras_float_dtype(module)
    params = [p for p in module.parameters() if p.is_floating_point()]
    return np.dtype(str(params[0].dtype).removeprefix("torch.")) if params else np.float32


def job_spec(trainer: Any, *, n_params: int | None = None, module: Any = None,
             devices: Any = None) -> JobSpec:
    """The engines' view of a Trainer's settings, built once; ``module`` is what the job starts
    from, ``devices`` the probed :class:`~dask_train.runtime._devices.Devices` (None: the CPU)."""
    if n_params is None and is_keras_model(trainer._model()):
        from dask_train.models._frameworks import keras_param_count

        n_params = keras_param_count(trainer._model())
    if n_params is None:
        n_params = int(flatten_parameters(trainer._model()).numel())
    return JobSpec(
        module=travelling(module if module is not None else copy.deepcopy(trainer._model()),
                          factory=trainer.module if is_factory(trainer.module) else None),
        n_params=n_params,
        loss=trainer.loss, optimizer=trainer.optimizer, lr=float(trainer.lr),
        optimizer_options=trainer.optimizer_options, batch_size=trainer.per_trainer_batch(),
        epochs=trainer.epochs, shuffle=trainer.shuffle, seed=trainer.seed,
        prefetch=-1 if trainer.prefetch == "auto" else int(trainer.prefetch),
        grad_accumulation=trainer.grad_accumulation,
        blocks_ahead=read_ahead(trainer.blocks_ahead)[0],
        blocks_ahead_max=read_ahead(trainer.blocks_ahead)[1], score_every=float(trainer.score_every),
        timeout=float(trainer.timeout), stop=trainer.stop, callbacks=trainer.callbacks,
        progress=trainer.progress, strategy=trainer._strategy(), ps=trainer._servers(),
        workers=trainer._trainers(), scorer=trainer.scorer, checkpoint=trainer.checkpoint,
        scorer_budget=scorer_budget(trainer.scorer_budget, trainer._trainers()),
        failure=trainer.failure or FailureConfig(), on_nan=trainer.on_nan,
        metrics=dict(trainer.metrics) if trainer.metrics else None,
        **({} if devices is None else {"device_kind": devices.kind,
                                       "devices": dict(devices.by_worker),
                                       "precision": devices.precision}),
    )


def scorer_budget(budget: Any, trainers: int) -> float | None:
    """The scorer's share of one core: ``"auto"`` is ``1 / (trainers + 1)``, what each role
    would get of one core it shared with every trainer."""
    if budget is None:
        return None
    return 1.0 / (max(1, int(trainers)) + 1) if budget == "auto" else float(budget)


def trainer_roles(trainer: Any, client: Any, *, has_validation: bool) -> Roles:
    """Where a torch fit's roles start, on ``client``'s workers."""
    from dask_train.runtime._roles import ensure_plugin, worker_threads

    ensure_plugin(client)
    threads = worker_threads(client)
    sync = trainer._strategy() == "sync"
    if sync and trainer._trainers() > len(threads):
        # torch's default process group is one per process: one rank per Dask worker.
        raise InvalidInput([
            f"workers={trainer.workers} is more than the {len(threads)} Dask workers of the "
            "cluster: strategy='sync' runs one rank per worker process; lower workers= or "
            "add workers."
        ])
    return Roles(plan_roles(threads, ps=0 if sync else trainer._servers(),
                            worker=trainer._trainers(),
                            scorer=trainer.scorer if has_validation else 0))


def replan_roles(trainer: Any, has_validation: bool) -> Callable[[Mapping[str, int]], Roles]:
    """The controller's placement of a new generation on the live workers (a sync job takes as
    many ranks as there are workers left, up to its own)."""

    def plan(alive: Mapping[str, int]) -> Roles:
        sync = trainer._strategy() == "sync"
        workers = trainer._trainers()
        return Roles(plan_roles(alive, ps=0 if sync else trainer._servers(),
                                worker=min(workers, len(alive)) if sync else workers,
                                scorer=trainer.scorer if has_validation else 0))

    return plan


def prepare_keras(client: Any, roles: Roles, *, timeout: float) -> None:
    """Ready the roles' workers for a Keras model (TensorFlow imported, serialization fixed)."""
    from dask_train.models._keras import warm_workers
    from dask_train.runtime._compat import fix_keras_serialization

    fix_keras_serialization()  # distributed's Keras serializer is for Keras 2
    warm_workers(client, roles.addresses, timeout=timeout)


def engine_class(strategy: str) -> Any:
    """The engine of a torch or Keras strategy (imported here: only the chosen one loads)."""
    if strategy == "sync":
        from dask_train.engines.torch_sync.engine import TorchSyncEngine

        return TorchSyncEngine
    from dask_train.engines.ps.engine import AsyncPSEngine

    return AsyncPSEngine


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


def fit_result(trainer: Any, outcome: Outcome, *, wall_s: float) -> FitResult:
    """The ``FitResult`` of a fit that ran ``outcome``."""
    log = outcome.log
    plan = getattr(trainer, "_plan", None)
    return FitResult(
        model=trained_model(trainer._model(), outcome.ending.params, outcome.ending.buffers),
        history=history_frame(log.records), stopped_by=outcome.stopped_by,
        steps=outcome.ending.steps, samples=outcome.ending.samples,
        epochs_completed=outcome.epochs_completed, wall_s=wall_s,
        ledger=ledger_frame(outcome.ledger), roles=outcome.roles,
        trainers=outcome.ending.trainers, failures=list(log.failures),
        checkpoints=list(log.checkpoints), nonfinite=list(log.nonfinite),
        generations=log.generations, model_step=outcome.model_step,
        validation_rows=dict((outcome.ending.final or {}).get("validation_rows") or {}),
        timings=phase_timings(getattr(trainer, "_clock", {}), log), started_at=log.started,
        plan=dict(plan.record) if plan is not None else {},
        scorer=scorer_record((outcome.ending.final or {}).get("cpu"), wall_s=wall_s),
    )
