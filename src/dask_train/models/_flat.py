"""The torch model adapter the engines use: flat parameter views on a device, gradients into a flat
host buffer, mixed precision, buffers and evaluation.

Every engine talks to a model through this interface (``flat``, ``n_params``, ``train_mode``,
``batch``, ``gradient``, ``forward_loss``, ``buffers``, ``evaluate``, ``read_params``), so a model
of another framework plugs in by offering the same methods (see :func:`flat_model`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from dask_train.models._buffers import BufferSet
from dask_train.models._frameworks import is_keras_model
from dask_train.models._torch import call_module, flatten_parameters, model_inputs, trainable

#: ``mixed_precision`` values and the autocast dtype each means.
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScale:
    """Dynamic loss scaling for float16 autocast (what ``torch.amp.GradScaler`` does, without an
    optimizer: the update happens elsewhere, on a server or after an all-reduce).

    The loss is multiplied by :attr:`scale` before backward so small float16 gradients do not
    flush to zero; gradients are divided by it again. An overflow (a non-finite gradient from a
    finite loss) halves the scale; every ``growth_interval`` clean batches double it.
    """

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale, self.growth_interval, self.clean = float(scale), growth_interval, 0

    def update(self, finite: bool) -> None:
        """Record one batch: halve on overflow, grow after a clean run."""
        if not finite:
            self.scale, self.clean = max(self.scale / 2.0, 1.0), 0
            return
        self.clean += 1
        if self.clean >= self.growth_interval:
            self.scale, self.clean = min(self.scale * 2.0, 2.0**24), 0


class FlatModel:
    """A module whose trainable parameters are views into one flat float32 vector on ``device``.

    Writing new values into :attr:`flat` changes the module in place, with no per-tensor copies
    on the hot path; :meth:`gradient` writes the flat gradient into a buffer the caller owns
    (on the host for a push, or anywhere).

    Parameters
    ----------
    module : torch.nn.Module
        Used as is (callers pass their own copy); moved to ``device``.
    device : str or torch.device, optional
        Where the forward and backward passes run (default: CPU).
    precision : {None, "bf16", "fp16"}
        Autocast dtype for the forward pass; ``"fp16"`` adds dynamic loss scaling. Parameters,
        gradients and optimizer state stay float32.

    Examples
    --------
    >>> fm = FlatModel(torch.nn.Linear(3, 2))
    >>> fm.flat.numel()
    8
    """

    def __init__(self, module: torch.nn.Module, *, device: str | torch.device | None = None,
                 precision: str | None = None) -> None:
        self.device = torch.device(device or "cpu")
        self.module = module.to(self.device)
        self.params = trainable(module)
        self.flat = flatten_parameters(module).to(self.device)
        offset = 0
        for p in self.params:
            n = p.numel()
            # Views, not copies: assigning new values to self.flat updates the module directly.
            p.data = self.flat[offset : offset + n].view_as(p)
            offset += n
        self.precision = precision
        self.scaler = LossScale() if precision == "fp16" else None
        self._host: torch.Tensor | None = None  # pinned staging for host <-> device copies
        # Per gradient buffer: its slices as each parameter's .grad (see gradient).
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}

    @property
    def n_params(self) -> int:
        """Number of trainable parameters."""
        return int(self.flat.numel())

    @property
    def on_host(self) -> bool:
        """Whether the parameters live in host memory (the flat vector is a numpy view)."""
        return self.device.type == "cpu"

    def train_mode(self) -> None:
        """Training mode (dropout on, BatchNorm updating its statistics)."""
        self.module.train()

    def set_flat(self, values: np.ndarray | torch.Tensor, *, start: int = 0) -> None:
        """Copy ``values`` into the flat parameters from position ``start``."""
        src = torch.from_numpy(np.asarray(values)) if isinstance(values, np.ndarray) else values
        self.flat[start : start + src.numel()].copy_(src)

    def write_slices(self, parts: list[tuple[int, int, np.ndarray]]) -> None:
        """Copy received parameter slices ``(start, stop, values)`` into the flat vector."""
        if self.on_host:
            # Through numpy: received arrays may be read-only frames, which torch.from_numpy
            # warns about; a numpy slice assignment copies without that.
            dst = self.flat.numpy()
            for start, stop, values in parts:
                dst[start:stop] = np.asarray(values)
            return
        host = self._staging()
        dst = host.numpy()
        for start, stop, values in parts:
            dst[start:stop] = np.asarray(values)
        # Blocking: the staging buffer is reused by the next call.
        self.flat.copy_(host)

    def read_params(self) -> np.ndarray:
        """A host copy of the flat parameters."""
        return self.flat.detach().to("cpu", copy=True).numpy()

    def _staging(self) -> torch.Tensor:
        if self._host is None:
            pin = self.device.type == "cuda"
            self._host = torch.empty(self.n_params, dtype=torch.float32, pin_memory=pin)
        return self._host

    def batch(self, x: np.ndarray, y: np.ndarray, w: np.ndarray | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A numpy batch as tensors on the device; integer inputs (token ids) keep their dtype.
        Several inputs (a record array) become a dict of tensors, by name."""
        device = None if self.on_host else self.device
        return (model_inputs(x, device), model_inputs(y, device),
                None if w is None else model_inputs(w, device))

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast to the chosen precision on the model's device (a no-op without one)."""
        if self.precision is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=PRECISIONS[self.precision]):
            yield

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Any,
                     w: torch.Tensor | None = None) -> torch.Tensor:
        """The batch loss (float32), the forward pass under autocast when mixed precision is on."""
        with self.autocast():
            out = call_module(self.module, x)
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            out = out.float()  # a structured output is the loss's to read (make_loss)
        # Weights only when there are any: a plain fn(output, target) works as the loss too.
        loss: torch.Tensor = loss_fn(out, y) if w is None else loss_fn(out, y, w)
        return loss

    def gradient(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Any, *, out: torch.Tensor,
                 w: torch.Tensor | None = None) -> float:
        """Compute the loss on one batch and write the flat gradient into ``out``; return the loss.

        With float16 loss scaling, a batch whose scaled gradient overflows is computed again at
        half the scale (an overflow is rare and the batch is not lost).
        """
        views = self._grad_views(out)
        for _ in range(64):
            if views is not None:
                # Autograd adds into an existing .grad in place: backward writes the flat
                # gradient straight into ``out``, with no gather of the pieces afterwards.
                out.zero_()
                for p, view in zip(self.params, views):
                    p.grad = view
            else:
                for p in self.params:
                    p.grad = None
            loss = self.forward_loss(x, y, loss_fn, w)
            value = float(loss.detach())
            scale = self.scaler.scale if self.scaler is not None else 1.0
            (loss * scale if scale != 1.0 else loss).backward()
            if views is None:
                out.copy_(torch.cat([p.grad.reshape(-1) if p.grad is not None else
                                     torch.zeros(p.numel(), device=self.device)
                                     for p in self.params]))
            if self.scaler is None:
                return value
            out.div_(scale)
            finite = bool(torch.isfinite(out).all()) or not math.isfinite(value)
            self.scaler.update(finite)
            if finite:
                return value
        return math.nan  # the scale reached 1 and still overflows: a non-finite batch

    def _grad_views(self, out: torch.Tensor) -> list[torch.Tensor] | None:
        """Each parameter's slice of ``out``, shaped as the parameter (cached per buffer: the
        engines reuse a few); None where ``out`` is not on the model's device."""
        if out.device != self.device or out.dtype != self.flat.dtype \
                or out.numel() != self.n_params:
            return None
        key = (out.data_ptr(), out.numel())
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 8:  # a caller with a new buffer each time: keep a few
                self._views.clear()
            views, offset = [], 0
            for p in self.params:
                views.append(out[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            self._views[key] = views
        return views

    def loss_fn(self, loss: Any) -> Any:
        """The engines' loss for a Trainer's ``loss=`` (see :func:`~._torch.make_loss`)."""
        from dask_train.models._torch import make_loss

        return make_loss(loss, device=self.device)

    def buffers(self) -> BufferSet:
        """The module's trained buffers (BatchNorm statistics) as one flat vector."""
        return BufferSet(self.module)

    def evaluate(self, x: np.ndarray, y: np.ndarray, *, loss: Any,
                 metrics: Mapping[str, Any] | None = None, batch_size: int = 4096) -> dict[str, float]:
        """Scores of the model on ``(x, y)`` (see :func:`dask_train.models._evaluate.evaluate`)."""
        from dask_train.models._evaluate import evaluate

        with self.autocast():
            return evaluate(self.module, x, y, loss=loss, metrics=metrics, batch_size=batch_size,
                            device=self.device)


def flat_model(module: Any, *, device: str | None = None, precision: str | None = None) -> Any:
    """The engine-side adapter of ``module``: a :class:`FlatModel` for a torch module, a
    :class:`~dask_train.models._keras.KerasFlatModel` for a Keras model.

    The one place engines turn a user's model into something they can train, so another
    framework's adapter is one more branch here.
    """
    if is_keras_model(module):
        from dask_train.models._keras import KerasFlatModel

        return KerasFlatModel(module, device=device, precision=precision)
    return FlatModel(module, device=device, precision=precision)
