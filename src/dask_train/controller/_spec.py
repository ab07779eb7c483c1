"""What a job is (its validated settings) and what outlives its generations (its log)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from dask_train.checkpoint import CheckpointConfig
from dask_train.policy._failure import FailureConfig
from dask_train.policy.callbacks import Callback
from dask_train.policy.stop import StopCondition


@dataclass
class JobSpec:
    """Everything the controller needs, validated by the Trainer before it is built."""

    module: torch.nn.Module
    n_params: int
    loss: str
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
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def max_step(self) -> int | None:
        """The tightest step limit among the stop conditions."""
        steps = [c.max_step for c in self.stop if c.max_step is not None]
        return min(steps) if steps else None


@dataclass
class JobLog:
    """What outlives a generation: history, failures, checkpoints, time already trained."""

    records: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    nonfinite: list[dict[str, Any]] = field(default_factory=list)
    elapsed_before: float = 0.0  # seconds trained before this fit (a resumed checkpoint's)
    started: float = field(default_factory=time.time)
    generations: int = 0

    @property
    def elapsed_offset(self) -> float:
        """Seconds to add to ``time.time() - started`` for a continuous time axis."""
        return self.elapsed_before
