"""A flat parameter vector with its optimizer: what a parameter server or a sync rank updates.

Every optimizer offered is element-wise, so one flat vector (or any contiguous slice of it, as a
parameter server holds) steps exactly as the module's tensors would.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dask_train.models._torch import build_optimizer


class FlatOptimizer:
    """A flat slice of the parameters, its gradient buffer and its optimizer state.

    A lock serializes updates, and the parameters returned are a copy taken under it, so a reply
    is never torn.

    Parameters
    ----------
    params : numpy.ndarray or torch.Tensor
        Initial values of the slice: an array is copied, a float32 tensor is updated in place (a
        sync rank updates its own model's flat parameters).
    optimizer : str
        A name from :data:`dask_train.models.OPTIMIZERS`.
    lr : float
    options : mapping
        Extra optimizer keyword arguments (momentum, betas, weight_decay, ...).
    max_step : int or None
        Updates beyond this many are refused, so a step limit is exact however many trainers
        push at once.
    grad : torch.Tensor or None
        The optimizer's gradient buffer; by default a new one. The sync engine passes the buffer
        its all-reduce fills, so a step needs no copy of the gradient (see :meth:`step`).
    """

    def __init__(
        self,
        params: np.ndarray | torch.Tensor,
        *,
        optimizer: str,
        lr: float,
        options: Mapping[str, Any],
        max_step: int | None = None,
        grad: torch.Tensor | None = None,
    ) -> None:
        values = params if isinstance(params, torch.Tensor) else torch.from_numpy(
            np.array(params, dtype=np.float32)
        )
        self.param = torch.nn.Parameter(values)
        self.grad = torch.zeros_like(self.param) if grad is None else grad
        self.param.grad = self.grad
        self.optimizer = build_optimizer(optimizer, [self.param], lr=lr, options=options)
        self.max_step = max_step
        self.version = 0
        self.samples = 0
        self._lock = threading.Lock()

    def at_limit(self) -> bool:
        """True once ``max_step`` updates are applied."""
        return self.max_step is not None and self.version >= self.max_step

    def step(self, samples: int) -> bool:
        """Apply the gradient already in :attr:`grad`; return whether the step limit is reached."""
        with self._lock:
            if self.at_limit():
                return True
            self._step(samples)
            return self.at_limit()

    def _step(self, samples: int) -> None:
        self.optimizer.step()
        self.version += 1
        self.samples += int(samples)

    def pull(self) -> tuple[np.ndarray, int, int]:
        """Return (parameters copy, version, samples)."""
        with self._lock:
            return self.param.detach().numpy().copy(), self.version, self.samples

    def save(self, path: str, *, metadata: Mapping[str, str]) -> dict[str, Any]:
        """Write the slice and its optimizer state to ``path`` (atomic); return what was saved."""
        from dask_train.checkpoint import save_shard

        with self._lock:
            saved = {"path": path, "version": self.version, "samples": self.samples,
                     "finite": True}
            if not bool(torch.isfinite(self.param).all()):
                # Never overwrite good checkpoints with bad parameters: the last good one stays.
                return {**saved, "path": None, "finite": False}
            meta = {"version": str(self.version), "samples": str(self.samples), **metadata}
            save_shard(path, param=self.param.detach(), optimizer=self.optimizer, metadata=meta)
            return saved

    def restore(self, state: Any, *, version: int, samples: int) -> None:
        """Load parameters and optimizer state (a ``checkpoint.ShardState``) into this slice."""
        from dask_train.checkpoint import restore_optimizer

        with self._lock:
            self.param.data.copy_(state.param)
            restore_optimizer(self.optimizer, state)
            self.version, self.samples = int(version), int(samples)
