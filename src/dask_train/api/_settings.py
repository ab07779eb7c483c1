"""A job's settings as records by concern, each checking its own values.

The Trainer keeps its flat scikit-learn parameters (``dt.search`` samples them by name,
``get_params``/``set_params`` work on them); at ``fit`` they become one :class:`Settings`: the
model and its optimizer (:class:`ModelSettings`), the data (``DataSettings``), the cluster
(``ClusterSettings``), scoring (``ScoringSettings``) and recovery (:class:`RecoverySettings`).
``dt.run`` and the CLI build the same data, cluster and recovery records, so each value is
checked in one place with one wording. The pure records live in :mod:`dask_train.policy._settings`;
those here need torch or the checkpoint layer. Every record lists its problems rather than
raising, so a fit reports all of them at once.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask_train.policy._settings import (
    ClusterSettings,
    DataSettings,
    OptimizerSettings,
    ScoringSettings,
    callback_problems,
    int_at_least,
    positive,
    stop_problems,
)

if TYPE_CHECKING:
    from distributed import Client

    from dask_train.checkpoint import CheckpointConfig
    from dask_train.policy._failure import FailureConfig
    from dask_train.policy.callbacks import Callback
    from dask_train.policy.stop import StopCondition

#: ``strategy=`` values of a Trainer.
STRATEGIES = ("async-ps", "sync", "auto")
#: ``on_nan=`` values.
ON_NAN = ("stop", "skip")


@dataclass(frozen=True)
class ModelSettings:
    """The model, how its loss and scores are computed, and the optimizer that updates it.

    ``module`` is the model itself (what a factory built, for a Trainer given one).
    """

    module: Any  # a torch.nn.Module, a Keras model, or what a Trainer's factory built
    loss: str | Callable[..., Any] = "cross_entropy"
    metrics: Mapping[str, Any] | None = None
    optimizer: str | type = "adam"
    lr: float = 1e-3
    optimizer_options: Mapping[str, Any] = field(default_factory=dict)
    grad_accumulation: int = 1
    prefetch: bool | int | str = True  # on, off, pushes in flight, or "auto"

    @property
    def keras(self) -> bool:
        """Whether the model is a Keras model (TensorFlow does its math and places it)."""
        from dask_train.models._frameworks import is_keras_model

        return is_keras_model(self.module)

    def problems(self, *, device: Any = "auto", mixed_precision: Any = False) -> list[str]:
        """What is wrong with these values (``device``, ``mixed_precision``: for the checks a
        Keras model or an ArrayModel makes of them)."""
        import torch

        from dask_train.models._array import ArrayModel

        problems: list[str] = []
        keras = self.keras
        if not isinstance(self.module, (torch.nn.Module, ArrayModel)) and not keras:
            problems.append(
                f"module={type(self.module).__name__} is invalid: pass a torch.nn.Module "
                "instance, a Keras 3 model, or a dt.ArrayModel (with strategy='sync')."
            )
        problems += self._loss_problems(device=device, mixed_precision=mixed_precision)
        problems += self._optimizer_problems()
        problems += positive("lr", self.lr)
        problems += int_at_least("grad_accumulation", self.grad_accumulation, 1)
        prefetch = int(self.prefetch) if isinstance(self.prefetch, bool) else self.prefetch
        if prefetch != "auto":
            problems += int_at_least("prefetch", prefetch, 0, also="'auto', True, False")
        problems += check_metrics(self.metrics, self.module, self.loss)
        if isinstance(self.module, ArrayModel) and (device not in ("auto", "cpu")
                                                    or mixed_precision):
            problems.append(f"device={device!r}, mixed_precision={mixed_precision!r} do not apply "
                            "to a dt.ArrayModel (numpy runs on the CPU): leave the defaults.")
        return problems

    def _loss_problems(self, *, device: Any, mixed_precision: Any) -> list[str]:
        from dask_train.models._torch import LOSSES

        loss = self.loss
        if self.keras:  # Keras losses, TensorFlow's devices (its own checks)
            from dask_train.models._keras_eval import check_settings as check_keras

            return check_keras(self.module, loss, device=device, mixed_precision=mixed_precision)
        if isinstance(loss, str) and loss not in LOSSES:
            return [f"loss={loss!r} is unknown: use one of {sorted(LOSSES)}, a torch.nn loss "
                    "module (e.g. torch.nn.CrossEntropyLoss(label_smoothing=0.1)) or a function "
                    "fn(output, target) -> scalar tensor."]
        if not isinstance(loss, str) and not callable(loss):
            return [f"loss={loss!r} is invalid: pass a loss name, a torch.nn loss module or a "
                    "function fn(output, target) -> scalar tensor."]
        return []

    def _optimizer_problems(self) -> list[str]:
        import torch

        from dask_train.models._torch import OPTIMIZERS

        optimizer = self.optimizer
        if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            if optimizer in (torch.optim.LBFGS,):
                return [f"optimizer={optimizer.__name__} is invalid: it needs a closure over the "
                        "whole model; use an element-wise optimizer such as torch.optim.SGD or "
                        "Adam."]
        elif optimizer not in OPTIMIZERS:
            return [f"optimizer={optimizer!r} is unknown: use one of {sorted(OPTIMIZERS)} or a "
                    "torch.optim.Optimizer subclass such as torch.optim.SGD."]
        return optimizer_options_problems(optimizer, self.lr, self.optimizer_options)

    def optim(self) -> OptimizerSettings:
        """The optimizer as the engines take it (call after :meth:`problems` found none)."""
        return OptimizerSettings(self.optimizer, float(self.lr), dict(self.optimizer_options or {}))

    def prefetch_count(self) -> int:
        """Pushes in flight: ``-1`` for ``"auto"`` (the trainers adapt it)."""
        return -1 if self.prefetch == "auto" else int(self.prefetch)


@dataclass(frozen=True)
class RecoverySettings:
    """What a job keeps to resume, what it survives, and what a non-finite loss does.

    ``checkpoint`` may be a path or URL: it stands for ``CheckpointConfig(path)``.
    """

    checkpoint: str | os.PathLike[str] | CheckpointConfig | None = None
    failure: FailureConfig | None = None
    on_nan: str = "stop"

    def problems(self) -> list[str]:
        """What is wrong with these values."""
        from dask_train.api._job_config import memory_state
        from dask_train.checkpoint import CheckpointConfig
        from dask_train.errors import InvalidInput
        from dask_train.policy._failure import FailureConfig

        problems: list[str] = []
        try:
            memory_state()
        except InvalidInput as exc:
            problems += list(exc.problems)
        try:
            CheckpointConfig.of(self.checkpoint)
        except InvalidInput as exc:
            problems += exc.problems
        if self.failure is not None and not isinstance(self.failure, FailureConfig):
            problems.append(f"failure={self.failure!r} is invalid: pass "
                            "dt.FailureConfig(max_failures=3) or None.")
        if self.on_nan not in ON_NAN:
            problems.append(
                f"on_nan={self.on_nan!r} is invalid: use 'stop' (end the job, keep the last "
                "good checkpoint) or 'skip' (leave the batch or score out and go on).")
        return problems

    def checkpoint_config(self) -> CheckpointConfig | None:
        """The :class:`~dask_train.checkpoint.CheckpointConfig` (None without checkpoints)."""
        from dask_train.checkpoint import CheckpointConfig

        return CheckpointConfig.of(self.checkpoint)

    def failure_config(self) -> FailureConfig:
        """The :class:`~dask_train.policy.FailureConfig`, the default one when none was given."""
        from dask_train.policy._failure import FailureConfig

        return self.failure or FailureConfig()


#: Which record holds each Trainer parameter, in ``Trainer.__init__``'s order. ``None``: the
#: bundle itself (the roles' counts, what stops the job, hooks, the client).
PARAMETERS: dict[str, str | None] = {
    "module": "model", "loss": "model", "metrics": "model", "optimizer": "model", "lr": "model",
    "optimizer_options": "model", "strategy": None, "ps": None, "workers": "cluster",
    "scorer": "scoring", "batch_size": "data", "global_batch_size": "data", "epochs": "data",
    "stop": None, "callbacks": None, "score_every": "scoring", "scorer_budget": "scoring",
    "shuffle": "data", "seed": "data", "prefetch": "model", "grad_accumulation": "model",
    "blocks_ahead": "data", "timeout": "cluster", "progress": None, "checkpoint": "recovery",
    "failure": "recovery", "on_nan": "recovery", "device": "cluster",
    "mixed_precision": "cluster", "resources": "cluster", "client": None,
}

_RECORDS = {"model": ModelSettings, "data": DataSettings, "cluster": ClusterSettings,
            "scoring": ScoringSettings, "recovery": RecoverySettings}


@dataclass(frozen=True)
class Settings:
    """A Trainer's parameters at ``fit``, one record per concern.

    Built by :meth:`of` from the flat parameters (``stop``/``callbacks`` as lists); the values
    are the user's, unchecked: :meth:`problems` says what is wrong with each.
    """

    model: ModelSettings
    data: DataSettings
    cluster: ClusterSettings
    scoring: ScoringSettings
    recovery: RecoverySettings
    strategy: str = "async-ps"
    ps: int = 1
    stop: list[StopCondition] = field(default_factory=list)
    callbacks: list[Callback] = field(default_factory=list)
    progress: bool = True
    client: Client | None = None

    @classmethod
    def of(cls, params: Mapping[str, Any], *, module: Any = None) -> Settings:
        """The records of a Trainer's flat ``params`` (``get_params()``); ``module``: the model
        a factory built, in place of the factory."""
        values = dict(params)
        if module is not None:
            values["module"] = module
        parts: dict[str, dict[str, Any]] = {name: {} for name in _RECORDS}
        own: dict[str, Any] = {}
        for name, value in values.items():
            where = PARAMETERS[name]
            (own if where is None else parts[where])[name] = value
        return cls(**{name: _RECORDS[name](**kw) for name, kw in parts.items()}, **own)

    @staticmethod
    def names() -> list[str]:
        """Every Trainer parameter, in ``Trainer.__init__``'s order."""
        return list(PARAMETERS)

    def problems(self) -> list[str]:
        """Every problem with these settings (no data needed), all at once."""
        cluster = self.cluster
        problems = self.model.problems(device=cluster.device,
                                       mixed_precision=cluster.mixed_precision)
        problems += self._strategy_problems()
        problems += cluster.problems(ranges=True)
        problems += self._range_problems()
        problems += self.scoring.problems()
        problems += self.data.problems(trainers=cluster.workers)
        problems += stop_problems(self.stop)
        problems += callback_problems(self.callbacks)
        problems += self.recovery.problems()
        return problems

    def _range_problems(self) -> list[str]:
        """``workers=(least, most)`` (or None) with what needs a fixed number of trainers."""
        w = self.cluster.workers
        if not self.cluster.ranged:
            return []
        problems = []
        if self.strategy == "auto":
            problems.append(f"workers={w!r} with strategy='auto': 'auto' measures which number "
                            "of trainers up to workers= is fastest; give it a count, or give the "
                            "range a strategy ('async-ps' or 'sync').")
        if self.data.global_batch_size is not None:
            problems.append(f"global_batch_size={self.data.global_batch_size!r} with workers="
                            f"{w!r}: the number of trainers follows the cluster, so the global "
                            "batch would not split evenly; give batch_size= (rows per trainer).")
        return problems

    def _strategy_problems(self) -> list[str]:
        """``strategy=`` and ``ps=`` (``"auto"`` for either measures torch modules only)."""
        problems = []
        keras = self.model.keras
        if self.strategy not in STRATEGIES:
            problems.append(f"strategy={self.strategy!r} is unknown: use one of "
                            f"{list(STRATEGIES)} ('auto': the fastest of async-ps, sync and one "
                            "process, measured on the cluster).")
        elif self.strategy == "auto" and keras:
            problems.append("strategy='auto' measures torch modules only: give a Keras model's "
                            "job strategy='async-ps' or 'sync'.")
        if self.ps == "auto" and keras:
            problems.append("ps='auto' measures torch modules only: give a Keras model's job a "
                            "server count, e.g. ps=1.")
        elif not (isinstance(self.ps, str) and self.ps == "auto"):
            # Servers exist only in async-ps; sync ignores ps.
            problems += int_at_least("ps", self.ps, 0 if self.strategy == "sync" else 1,
                                     also="'auto'")
        return problems

    def replace(self, **changes: Any) -> Settings:
        """A copy with some of the bundle's own fields changed."""
        return dataclasses.replace(self, **changes)


def optimizer_options_problems(name: Any, lr: Any, options: Mapping[str, Any]) -> list[str]:
    """The optimizer's own checks of ``lr`` and ``options``, without building one.

    Each torch optimizer checks its arguments (unknown names, a negative rate, Nesterov without
    momentum) before ``Optimizer.__init__`` takes the parameters; given none, that raises right
    after. Building a real one would import ``torch._dynamo`` (``add_param_group`` is wrapped
    by ``torch._disable_dynamo``): 3 s of the client's start-up here, for a check.
    """
    from dask_train.models._torch import OPTIMIZERS

    cls: Any = OPTIMIZERS[name] if isinstance(name, str) else name
    try:
        cls([], lr=lr, **dict(options or {}))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ValueError) and _NO_PARAMETERS in str(exc):
            return []  # every check of the arguments passed
        return [f"optimizer_options={dict(options or {})!r} are invalid for {name!r}: {exc}."]
    return []


#: What torch's Optimizer says when given no parameters: raised after the subclass's own checks.
_NO_PARAMETERS = "empty parameter list"


def job_metrics(module: Any, loss: Any, metrics: Mapping[str, Any] | None = None) -> list[str]:
    """The metrics a job's scores will hold."""
    from dask_train.models._array import ArrayModel
    from dask_train.models._evaluate import metric_names
    from dask_train.models._frameworks import is_keras_model

    if isinstance(module, ArrayModel):
        return ["loss"] + (["accuracy"] if module.predict is not None else [])
    if is_keras_model(module):
        from dask_train.models._keras_eval import metric_names as keras_metric_names

        return keras_metric_names(loss, metrics)
    return metric_names(loss, metrics)


def check_metrics(metrics: Any, module: Any, loss: Any) -> list[str]:
    """Problems with ``metrics=``: a mapping of names to built-in names, functions of
    (output, target), or objects with update/compute/reset."""
    from dask_train.models._array import ArrayModel
    from dask_train.models._torch import loss_name

    if metrics is None:
        return []
    if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
        return [f"metrics={metrics!r} is invalid: pass a dict of name -> 'accuracy', a function "
                "fn(output, target) -> number, or a torchmetrics metric object."]
    if isinstance(module, ArrayModel):
        return [f"metrics={sorted(metrics)} is not available for a dt.ArrayModel: its scores hold "
                "loss (and accuracy with a predict function); drop metrics=."]
    problems = []
    for name, metric in metrics.items():
        if isinstance(metric, str):
            if metric not in job_metrics(module, loss):
                problems.append(
                    f"metrics[{name!r}]={metric!r} is not a metric of loss={loss_name(loss)}: "
                    f"use one of {job_metrics(module, loss)}, a function or a metric object.")
        elif not (callable(metric) or
                  all(hasattr(metric, a) for a in ("update", "compute", "reset"))):
            problems.append(f"metrics[{name!r}]={metric!r} is invalid: use a function "
                            "fn(output, target) -> number or an object with update/compute/reset.")
    return problems
