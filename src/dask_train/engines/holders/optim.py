"""A flat parameter vector with its optimizer: what a parameter server or a sync rank updates.

Every optimizer offered is element-wise, so one flat vector (or any contiguous slice of it, as a
parameter server holds) steps exactly as the module's tensors would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from dask_train.models._torch import build_optimizer
from dask_train.policy._settings import OptimizerSettings

T = TypeVar("T")

# Slices smaller than this (in elements; 2**17 float32 = 512 KiB) are updated and copied inline on
# the event loop: their Adam step and copy take ~0.1-0.3 ms, about what the hop to another thread
# and back costs (~50-100 us on a busy 2-core machine, plus a wake-up of the loop), so the hop
# would only slow small models down while blocking the loop for no noticeable time. Larger slices
# go to the slice's own thread: a 17M-element Adam step blocks for ~100 ms or more, which starves
# the worker's heartbeats and every other RPC.
OFF_LOOP_MIN_ELEMENTS = 1 << 17


class FlatOptimizer:
    """A flat slice of the parameters, its gradient buffer and its optimizer state.

    A lock serializes updates, and the parameters returned are a copy taken under it, so a reply
    is never torn.

    Parameters
    ----------
    params : numpy.ndarray or torch.Tensor
        Initial values of the slice: an array is copied, a float32 tensor is updated in place (a
        sync rank updates its own model's flat parameters).
    optim : OptimizerSettings
        The optimizer, its learning rate and its other keyword arguments.
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
        optim: OptimizerSettings,
        *,
        max_step: int | None = None,
        grad: torch.Tensor | None = None,
    ) -> None:
        values = params if isinstance(params, torch.Tensor) else torch.from_numpy(
            np.array(params, dtype=np.float32)
        )
        self.param = torch.nn.Parameter(values)
        self.grad = torch.zeros_like(self.param) if grad is None else grad
        self.param.grad = self.grad
        self.optimizer = build_optimizer(optim, [self.param])
        self.max_step = max_step
        # The model's trained buffers (a float64 vector, see models._buffers) on the one holder
        # that keeps them, else None: handed out with the parameters by pull, saved with them.
        self._buffers: np.ndarray | torch.Tensor | None = None
        self.version = 0
        self.samples = 0
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    @property
    def buffers(self) -> np.ndarray | None:
        """The buffers as a float64 array; kept on a GPU, they are copied to the host when first
        read (a scorer's pull, a checkpoint), not at every step that publishes them."""
        held = self._buffers
        if isinstance(held, torch.Tensor):
            held = self._buffers = held.cpu().numpy()
        return held

    @buffers.setter
    def buffers(self, values: np.ndarray | torch.Tensor | None) -> None:
        self._buffers = values

    @property
    def off_loop(self) -> bool:
        """Whether :meth:`run` sends work to this slice's own thread (large slices only)."""
        return self.param.numel() >= OFF_LOOP_MIN_ELEMENTS

    async def run(self, fn: Callable[..., T], /, *args: Any) -> T:
        """Run ``fn(*args)`` (an update or a copy of this slice) from a coroutine on the event loop.

        A large slice's work runs on a single thread owned by the slice, so the loop stays free
        for heartbeats and other RPCs meanwhile. One thread, not a pool: calls run in the order
        they were made (the lock alone would let a later push overtake an earlier one), and two
        updates of one slice could not run in parallel anyway. Torch uses its process-wide
        intra-op thread count there (set once by ``WorkerState.configure_torch``).
        """
        if not self.off_loop:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread(), functools.partial(fn, *args))

    def _thread(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="dask-train-params"
                )
            return self._executor

    def close(self) -> None:
        """Let the slice's thread end once the work already queued is done."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)

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

    @property
    def can_queue_steps(self) -> bool:
        """Whether :meth:`queue_step` can run: a fused torch optimizer (Adam, AdamW, SGD),
        whose kernel reads its gradient scale and skip flag where the parameters are."""
        return bool(self.optimizer.defaults.get("fused")) and len(self.optimizer.param_groups) == 1

    def queue_step(self, scale: torch.Tensor, skip: torch.Tensor) -> bool:
        """Queue a step on the device that divides the gradient by ``scale`` and does nothing
        where ``skip`` is nonzero (one-element tensors on the device, read there by the fused
        kernel, as ``torch.amp.GradScaler`` has it do): the host does not wait for the device.
        :meth:`count_step` counts it once the caller knows it applied. False (nothing queued)
        at the step limit."""
        with self._lock:
            if self.at_limit():
                return False
            opt: Any = self.optimizer
            opt.grad_scale, opt.found_inf = scale, skip
            try:
                opt.step()
            finally:
                opt.grad_scale = opt.found_inf = None
            return True

    def count_step(self, samples: int) -> bool:
        """Count a step :meth:`queue_step` queued and that applied; whether the step limit is
        reached."""
        with self._lock:
            self.version += 1
            self.samples += int(samples)
            return self.at_limit()

    def pull(self) -> tuple[np.ndarray, int, int, np.ndarray | None]:
        """Return (parameters copy, version, samples, buffers).

        The buffers array is never written in place (a new one replaces it), so it needs no copy.
        """
        with self._lock:
            return (self.param.detach().to("cpu", copy=True).numpy(), self.version, self.samples,
                    self.buffers)

    def set_buffers(self, values: np.ndarray | torch.Tensor | None) -> None:
        """Keep ``values`` (a float64 buffer vector, or a tensor on a GPU, this holder may keep
        as is) as the buffers."""
        if values is not None:
            with self._lock:
                self.buffers = values

    def save(self, path: str, *, metadata: Mapping[str, str]) -> dict[str, Any]:
        """Write the slice and its optimizer state to ``path`` (atomic); return what was saved.

        The file is encoded under the lock and written after it (to a disk, an object store,
        other workers' memory): held through the write, the lock kept the scorer's pulls
        waiting on a holder slow to answer."""
        from dask_train.checkpoint._io import write_encoded
        from dask_train.checkpoint._shard import encode_shard

        with self._lock:
            saved = {"path": path, "version": self.version, "samples": self.samples,
                     "finite": True}
            if not bool(torch.isfinite(self.param).all()):
                # Never overwrite good checkpoints with bad parameters: the last good one stays.
                return {**saved, "path": None, "finite": False}
            meta = {"version": str(self.version), "samples": str(self.samples), **metadata}
            buffers = None if self.buffers is None else torch.from_numpy(self.buffers)
            data = encode_shard(param=self.param.detach(), optimizer=self.optimizer,
                                metadata=meta, buffers=buffers)
        write_encoded(data, path)
        return saved

    def restore(self, state: Any, *, version: int, samples: int) -> None:
        """Load parameters and optimizer state (a ``checkpoint.ShardState``) into this slice."""
        from dask_train.checkpoint import restore_optimizer

        with self._lock:
            self.param.data.copy_(state.param)
            restore_optimizer(self.optimizer, state)
            if getattr(state, "buffers", None) is not None:
                self.buffers = state.buffers.numpy().astype(np.float64)
            self.version, self.samples = int(version), int(samples)
