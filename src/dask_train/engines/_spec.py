"""What a job is: its validated settings, as the controller and the engines read them
(:class:`JobSpec`, built once by the Trainer), and the part of them every role on a worker
receives (:class:`WorkerConfig`)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dask_train.checkpoint import CheckpointConfig
from dask_train.policy._failure import FailureConfig
from dask_train.policy.callbacks import Callback
from dask_train.policy.stop import StopCondition


@dataclass(frozen=True)
class JobSpec:
    """Everything the controller needs, validated by the Trainer before it is built, with the
    devices and precision already resolved (frozen: nothing changes it once built)."""

    module: Any  # a torch.nn.Module (torch engines) or an ArrayModel (numpy engine)
    n_params: int
    loss: Any  # a name, an nn.Module or a callable (models._torch.resolve_loss)
    optimizer: str
    lr: float
    optimizer_options: dict[str, Any]
    batch_size: int
    epochs: int
    shuffle: bool
    seed: int
    prefetch: int
    grad_accumulation: int
    blocks_ahead: int
    score_every: float
    timeout: float
    stop: list[StopCondition]
    callbacks: list[Callback]
    progress: bool
    strategy: str = "async-ps"
    ps: int = 1
    workers: int = 1
    scorer: int = 1
    checkpoint: CheckpointConfig | None = None
    failure: FailureConfig = field(default_factory=FailureConfig)
    on_nan: str = "stop"
    metrics: dict[str, Any] | None = None  # extra scores: name -> function or metric object
    device_kind: str = "cpu"  # "cpu" or "cuda" (runtime._devices.Devices)
    devices: dict[str, str] = field(default_factory=dict)  # worker address -> torch device
    precision: str | None = None  # autocast dtype: None, "bf16" or "fp16"
    data: str = ""  # how the training data reaches the trainers (persisted, streamed), and why
    #: The most blocks a starved trainer of streamed data may be granted ahead
    #: (``blocks_ahead="auto"``); ``blocks_ahead`` or less: its credit never grows.
    blocks_ahead_max: int = 0
    #: The share of one core the scorer may spend scoring (resolved from the Trainer's
    #: ``scorer_budget``), None for no limit.
    scorer_budget: float | None = None
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def max_step(self) -> int | None:
        """The tightest step limit among the stop conditions."""
        steps = [c.max_step for c in self.stop if c.max_step is not None]
        return min(steps) if steps else None


@dataclass(frozen=True)
class WorkerConfig:
    """The settings every trainer, rank and scorer of one generation receives.

    Built by the engine from the :class:`JobSpec` (:meth:`from_spec`); it travels to the workers
    pickled with the role's task, and a field read there that does not exist fails at once.
    """

    loss: Any
    batch_size: int
    prefetch: int
    grad_accumulation: int
    timeout: float
    topic: str
    score_every: float
    optimizer: str
    lr: float
    optimizer_options: dict[str, Any]
    max_step: int | None
    seed: int
    on_nan: str
    #: RNG state per trainer index (text), restored from a checkpoint; empty for a fresh start.
    rng: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, Any] | None = None
    device_kind: str = "cpu"
    devices: dict[str, str] = field(default_factory=dict)
    precision: str | None = None
    #: ``{"files", "step", "samples"}`` of the checkpoint every sync rank loads itself, or None.
    restore: dict[str, Any] | None = None
    #: The keys of validation blocks scored where they live (``SpreadValidation``), or None.
    validation_keys: list[str] | None = None
    #: The generation's secret for direct pushes to its servers (async-ps), b"" for none.
    push_secret: bytes = field(default=b"", repr=False)
    #: The share of one core the scorer may spend scoring (``scoring.ScoreSchedule``), or None.
    scorer_budget: float | None = None

    @classmethod
    def from_spec(cls, spec: JobSpec, *, topic: str,
                  restore: Mapping[str, Any] | None = None) -> WorkerConfig:
        """The roles' view of ``spec``; ``restore`` is the checkpoint the generation starts from."""
        return cls(
            loss=spec.loss, batch_size=spec.batch_size, prefetch=spec.prefetch,
            grad_accumulation=spec.grad_accumulation, timeout=spec.timeout, topic=topic,
            score_every=spec.score_every, optimizer=spec.optimizer, lr=spec.lr,
            optimizer_options=dict(spec.optimizer_options), max_step=spec.max_step,
            seed=spec.seed, on_nan=spec.on_nan, rng=dict((restore or {}).get("rng") or {}),
            metrics=spec.metrics, device_kind=spec.device_kind, devices=dict(spec.devices),
            precision=spec.precision, scorer_budget=spec.scorer_budget,
        )

    def device_for(self, address: str) -> str | None:
        """The torch device the roles on ``address`` use: the one chosen for that worker, the
        current CUDA device for a worker that joined after the start, None for the CPU."""
        device = self.devices.get(address)
        if device is None and self.device_kind == "cuda":
            device = "cuda"
        return device
