"""Trials of a :class:`~dask_train.Trainer`: each one a distributed job on its own reserved workers."""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Mapping
from typing import Any

from distributed import Client

from dask_train.api import Trainer
from dask_train.errors import InvalidInput
from dask_train.models._array import ArrayModel
from dask_train.policy._placement import Placement, resource_problems
from dask_train.policy._scope import use_workers
from dask_train.tuning._data import SearchData
from dask_train.tuning._space import Space
from dask_train.tuning._trial import (
    PRUNED,
    Outcome,
    Pruned,
    ReportScores,
    SearchStop,
    TrialContext,
    TrialRunner,
    last_score,
)

# Building a module seeds torch's global generator: one trial thread at a time.
_BUILD_LOCK = threading.Lock()


def _is_module(obj: Any) -> bool:
    import torch

    return isinstance(obj, (torch.nn.Module, ArrayModel))


class TrainerTrials(TrialRunner):
    """Each trial: a copy of ``trainer`` with the trial's parameters, fitted on its gang.

    Space names that are Trainer parameters (``lr``, ``batch_size``, ``optimizer``, ``workers``...)
    set the Trainer; the others are passed to the module factory when ``trainer.module`` is one
    (a function returning a new torch module, e.g. ``net_fn(hidden=256)``), seeded with the
    Trainer's ``seed`` so every trial starts from the same draw.
    """

    kind = "trainer"

    def __init__(self, trainer: Trainer, space: Space, *, data: SearchData, metric: str,
                 client: Client, workers_per_trial: int | None) -> None:
        self.trainer, self.space, self.data, self.metric = trainer, space, data, metric
        self.client, self.workers_per_trial = client, workers_per_trial
        module = trainer.module
        self.factory = module if callable(module) and not _is_module(module) else None

    # -- checks -----------------------------------------------------------------------------------
    def _trainer_names(self) -> set[str]:
        return set(self.trainer.get_params()) - {"module", "client"}

    def _factory_accepts(self) -> tuple[set[str], bool]:
        """The factory's keyword names, and whether it takes any (``**kwargs``)."""
        if self.factory is None:
            return set(), False
        params = inspect.signature(self.factory).parameters.values()
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        return names, any(p.kind is p.VAR_KEYWORD for p in params)

    def split(self, params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(Trainer parameters, module factory parameters)."""
        names = self._trainer_names()
        return ({k: v for k, v in params.items() if k in names},
                {k: v for k, v in params.items() if k not in names})

    def problems(self) -> list[str]:
        module = self.trainer.module
        if self.factory is None and not _is_module(module):
            return [f"Trainer(module={module!r}) is invalid for a search: pass a torch module, a "
                    "dt.ArrayModel, or a function returning a new torch module."]
        names, any_name = self._factory_accepts()
        problems = []
        for name in self.space.all_names:
            if name in self._trainer_names() or name in names or any_name:
                continue
            where = f"the Trainer or of {getattr(self.factory, '__name__', 'the factory')}()" \
                if self.factory is not None else "the Trainer (pass a module factory to search " \
                "module settings)"
            problems.append(f"space[{name!r}] is not a parameter of {where}: use one of "
                            f"{sorted(self._trainer_names() | names)}.")
        if problems:
            return problems
        return self._check_first_trial()

    def _check_first_trial(self) -> list[str]:
        """The Trainer's own checks on the space's first values (a module built, a batch through
        it, the metric among the job's scores) before any work."""
        from dask_train.api._settings import job_metrics

        first = self.space.first()
        try:
            trainer = self._trainer(first, extra_stop=[], callbacks=[])
            trainer.check(self.data.X, self.data.y, self.data.validation)
        except InvalidInput as exc:
            return [f"with the space's first values {first}: {p}" for p in exc.problems]
        except Exception as exc:  # the user's factory failing
            return [f"building the model with the space's first values {first} failed: "
                    f"{type(exc).__name__}: {exc}"]
        names = job_metrics(trainer.module, trainer.loss, trainer.metrics)
        if self.metric not in names:
            return [f"metric={self.metric!r} is not a score of this Trainer's jobs: use one of "
                    f"{names}."]
        return []

    # -- trials -----------------------------------------------------------------------------------
    def workers_needed(self, params: Mapping[str, Any]) -> int:
        if self.workers_per_trial is not None:
            return self.workers_per_trial
        workers = self.split(params)[0].get("workers", self.trainer.workers)
        # A range reserves its least: the trial's job then runs with those.
        return int(workers[0] if isinstance(workers, tuple) else 1 if workers is None else workers)

    def placement(self, params: Mapping[str, Any]) -> Placement:
        # The trial's gang is only workers with its trainers' resources, so the job's servers
        # and scorer share them (a trial runs on its gang alone).
        resources = self.split(params)[0].get("resources", self.trainer.resources)
        return Placement() if resource_problems(resources) else Placement.of(resources)

    def _module(self, params: Mapping[str, Any], seed: int) -> Any:
        if self.factory is None:
            return copy.deepcopy(self.trainer.module)
        import torch

        with _BUILD_LOCK:
            torch.manual_seed(seed)
            return self.factory(**params)

    def _trainer(self, params: Mapping[str, Any], *, extra_stop: list[Any],
                 callbacks: list[Any]) -> Trainer:
        settings = self.trainer.get_params()
        trainer_params, module_params = self.split(params)
        settings.update(trainer_params)
        # Stop conditions keep state per job (EarlyStopping): each trial gets its own copies.
        stop = [copy.deepcopy(c) for c in settings["stop"]] + extra_stop
        return Trainer(**{**settings, "module": self._module(module_params, settings["seed"]),
                          "stop": stop, "callbacks": [*settings["callbacks"], *callbacks],
                          "progress": False, "client": self.client})

    def run(self, ctx: TrialContext) -> Outcome:
        epochs = self.split(ctx.params)[0].get("epochs", self.trainer.epochs)
        planned = float(epochs) * float(self.data.X.shape[0])
        # The trial's own stop conditions come first: one that fires at the score where the
        # pruner also says stop is why the job ended (complete, not pruned).
        trainer = self._trainer(ctx.params, extra_stop=[Pruned(ctx), SearchStop(ctx.stopping)],
                                callbacks=[ReportScores(ctx, self.metric, planned)])
        with use_workers(ctx.gang, cache=ctx.cache):
            result = trainer.fit(self.data.X, self.data.y, validation=self.data.validation)
        history = result.history[["time_s", self.metric]].dropna()
        return Outcome(score=last_score(result.history, self.metric), model=result.model,
                       history=history, stopped_by=result.stopped_by, result=result,
                       info={"steps": result.steps, "samples": result.samples},
                       # The pruner ended it only if it stopped it before its epochs were done.
                       pruned=result.stopped_by == PRUNED and result.epochs_completed < epochs)

