"""What a job is: its validated settings, as every engine and the controller read them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from dask_train.checkpoint import CheckpointConfig
from dask_train.policy._failure import FailureConfig
from dask_train.policy.callbacks import Callback
from dask_train.policy.stop import StopCondition


@dataclass
class JobSpec:
    """Everything the controller needs, validated by the Trainer before it is built."""

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
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def max_step(self) -> int | None:
        """The tightest step limit among the stop conditions."""
        steps = [c.max_step for c in self.stop if c.max_step is not None]
        return min(steps) if steps else None
