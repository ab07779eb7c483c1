"""What a job is, as the controller and the engines read it.

:class:`JobSpec` holds what every job has (its id, strategy, trainers, how the data is fed, stop
conditions, callbacks, checkpoints, failures, devices). An engine that trains a model it is given
(async-ps, sync torch, numpy) also gets :class:`TrainSettings`: the model, its loss, optimizer and
scoring. A ``dt.run`` job has none, since the user's function owns its model and optimizer: it
has what its ranks get besides the function instead
(:class:`~dask_train.engines.run.context.RunSettings`). What goes
into a checkpoint's manifest is said by each part (:meth:`JobSpec.manifest_config`), so a
``dt.run`` manifest names no optimizer. :class:`RoleConfig` is the part of a spec every role on
a worker receives.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dask_train.checkpoint import CheckpointConfig
from dask_train.policy._copies import COPY_EVERY_S
from dask_train.policy._failure import FailureConfig
from dask_train.policy._placement import Placement
from dask_train.policy._settings import OptimizerSettings
from dask_train.policy.callbacks import Callback
from dask_train.policy.stop import StopCondition


@dataclass(frozen=True)
class TrainSettings:
    """The model an engine trains and how: loss, optimizer, pushes in flight, servers, scoring.

    Validated by the Trainer before it is built (``api._settings``).
    """

    module: Any  # a torch.nn.Module, a Keras model or an ArrayModel; None in a RoleConfig
    n_params: int
    loss: Any  # a name, an nn.Module or a callable (models._torch.resolve_loss)
    optim: OptimizerSettings
    prefetch: int = 0  # pushes in flight; -1: adapted by the trainers ("auto")
    grad_accumulation: int = 1
    ps: int = 0  # parameter servers (async-ps); 0 for sync engines
    scorer: int = 1
    score_every: float = 1.0
    #: The share of one core the scorer may spend scoring, None for no limit.
    scorer_budget: float | None = None
    metrics: dict[str, Any] | None = None  # extra scores: name -> function or metric object

    @property
    def optimizer_name(self) -> str:
        """The optimizer as a manifest or a page names it."""
        return self.optim.label

    def manifest(self) -> dict[str, Any]:
        """What a checkpoint records of these settings (JSON-able)."""
        return {"optimizer": self.optimizer_name, "lr": self.optim.lr,
                "grad_accumulation": self.grad_accumulation}

    def summary(self) -> dict[str, Any]:
        """What the Training page shows of them."""
        return {"optimizer": self.optimizer_name, "lr": self.optim.lr, "n_params": self.n_params,
                "score_every": self.score_every}


@dataclass(frozen=True)
class JobSpec:
    """Everything the controller needs, validated before it is built, with the devices and
    precision already resolved (frozen: nothing changes it once built)."""

    strategy: str  # the engine's key in the registry (engines._registry)
    workers: int  # trainers, or ranks
    batch_size: int  # rows of one trainer's batch
    epochs: int
    shuffle: bool
    seed: int
    blocks_ahead: int
    timeout: float
    stop: list[StopCondition]
    callbacks: list[Callback]
    #: The model and how it is trained, for the engines that train a model they are given;
    #: None for ``dt.run``, whose function owns them.
    train: TrainSettings | None = None
    #: What every rank of a ``dt.run`` job gets besides its function
    #: (``engines.run.context.RunSettings``, not imported here: it imports this module);
    #: None for the others.
    run: Any = None
    progress: bool = False
    checkpoint: CheckpointConfig | None = None
    failure: FailureConfig = field(default_factory=FailureConfig)
    on_nan: str = "stop"
    device_kind: str = "cpu"  # "cpu" or "cuda" (runtime._devices.Devices)
    devices: dict[str, str] = field(default_factory=dict)  # worker address -> torch device
    precision: str | None = None  # autocast dtype: None, "bf16" or "fp16"
    data: str = ""  # how the training data reaches the trainers (persisted, streamed), and why
    #: The most blocks a starved trainer of streamed data may be granted ahead
    #: (``blocks_ahead="auto"``); ``blocks_ahead`` or less: its credit never grows.
    blocks_ahead_max: int = 0
    #: The most trainers workers that join may bring the job to (``workers=(least, most)``);
    #: None with ``workers=None`` (every worker); ``workers`` itself when it is a count.
    most_workers: int | None = -1
    #: Where the trainers (ranks) may run: the Dask worker resources each holds.
    placement: Placement = field(default_factory=Placement)
    #: Seconds between the in-memory copies of a job's state (``dask-train.copy-every``; 0:
    #: none), see :func:`~dask_train.policy._copies.copies_wanted`.
    copy_every_s: float = COPY_EVERY_S
    #: Where state kept in memory goes (``dask-train.memory-state``:
    #: :data:`~dask_train.policy._copies.MEMORY_STATE`).
    memory_state: str = "auto"
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def trainer_cap(self) -> int | None:
        """The most trainers this job takes (None: as many as the cluster has workers)."""
        return self.workers if self.most_workers == -1 else self.most_workers

    @property
    def n_params(self) -> int:
        """Parameters the job's holders keep (0 for ``dt.run``: the ranks keep their own)."""
        return self.train.n_params if self.train is not None else 0

    @property
    def max_step(self) -> int | None:
        """The tightest step limit among the stop conditions."""
        steps = [c.max_step for c in self.stop if c.max_step is not None]
        return min(steps) if steps else None

    def manifest_config(self) -> dict[str, Any]:
        """What a checkpoint's manifest records of the settings (JSON-able): the data's for
        every job, and the training settings' for an engine that has them."""
        data = {"batch_size": self.batch_size, "seed": self.seed, "epochs": self.epochs}
        return {**(self.train.manifest() if self.train is not None else {}), **data}

    def summary(self) -> dict[str, Any]:
        """What the Training page shows of the job's settings."""
        return {"strategy": self.strategy, "epochs": self.epochs, "batch_size": self.batch_size,
                "data": self.data, **(self.train.summary() if self.train is not None else {})}


@dataclass(frozen=True)
class RoleConfig:
    """The settings every trainer, rank and scorer of one generation receives.

    Built by the engine from the :class:`JobSpec` (:meth:`from_spec`); it travels to the workers
    pickled with the role's task, and a field read there that does not exist fails at once.
    """

    batch_size: int
    timeout: float
    topic: str
    max_step: int | None
    seed: int
    on_nan: str
    #: The job's :class:`TrainSettings` without the module (it reaches each worker once, as
    #: the role tasks' ``module`` argument); None for ``dt.run``.
    train: TrainSettings | None = None
    #: RNG state per trainer index (text), restored from a checkpoint; empty for a fresh start.
    rng: dict[str, str] = field(default_factory=dict)
    device_kind: str = "cpu"
    devices: dict[str, str] = field(default_factory=dict)
    precision: str | None = None
    #: ``{"files", "step", "samples"}`` of the checkpoint every sync rank loads itself, or None.
    restore: dict[str, Any] | None = None
    #: The keys of validation blocks scored where they live (``SpreadValidation``), or None.
    validation_keys: list[str] | None = None
    #: The generation's secret for direct pushes to its servers (async-ps), b"" for none.
    push_secret: bytes = field(default=b"", repr=False)

    @classmethod
    def from_spec(cls, spec: JobSpec, *, topic: str,
                  restore: Mapping[str, Any] | None = None) -> RoleConfig:
        """The roles' view of ``spec``; ``restore`` is the checkpoint the generation starts from."""
        train = None if spec.train is None else dataclasses.replace(
            spec.train, module=None, optim=dataclasses.replace(
                spec.train.optim, options=dict(spec.train.optim.options)))
        return cls(
            batch_size=spec.batch_size, timeout=spec.timeout, topic=topic,
            max_step=spec.max_step, seed=spec.seed, on_nan=spec.on_nan, train=train,
            rng=dict((restore or {}).get("rng") or {}), device_kind=spec.device_kind,
            devices=dict(spec.devices), precision=spec.precision,
        )

    @property
    def trains(self) -> TrainSettings:
        """The training settings of a role that trains a given model (never ``dt.run``'s)."""
        assert self.train is not None, "a dt.run role has no training settings"
        return self.train

    def device_for(self, address: str) -> str | None:
        """The torch device the roles on ``address`` use: the one chosen for that worker, the
        current CUDA device for a worker that joined after the start, None for the CPU (also on
        a worker without CUDA beside GPU workers: a scorer off the trainers' ``resources=``).
        Called on the role's worker."""
        device = self.devices.get(address)
        if device is None and self.device_kind == "cuda":
            import torch

            device = "cuda" if torch.cuda.is_available() else None
        return device
