"""A module's buffers (BatchNorm running statistics and counters) as one flat float64 vector.

Parameters travel as the flat float32 vector of :class:`~dask_train.models._torch.FlatModel`;
buffers are not trained by gradients but change in the forward pass, so they travel beside it:
trainers send theirs with their pushes, a holder keeps them, pulls hand them back, checkpoints
store them.

Why one float64 vector, not float32 and not one vector per dtype: float64 holds every float32,
float16 and bfloat16 value exactly and every integer up to 2**53 (``num_batches_tracked`` is an
int64 counter of batches; no run gets near 2**53), so the round trip is lossless for every buffer
a model trains, while one vector is still one array in a message and one tensor in a checkpoint.
Putting the int64 counter into the float32 parameter vector instead would lose it past 2**24.
"""

from __future__ import annotations

import numpy as np
import torch

_INTEGER = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool})


def trained_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers a training forward pass may change, in ``module.named_buffers()`` order.

    Persistent (``state_dict``) floating, integer or bool buffers: a bool flag may change in a
    forward pass (an ActNorm layer's ``initialized``), and travels as 0.0/1.0. Non-persistent
    buffers are derived constants by torch's convention (a rotary table, a causal mask) and stay
    out.
    """
    persistent = set(module.state_dict(keep_vars=True))
    return [b for name, b in module.named_buffers()
            if name in persistent and (b.is_floating_point() or b.dtype in _INTEGER)]


class BufferSet:
    """Gathers a module's trained buffers into a flat float64 vector and writes them back.

    Parameters
    ----------
    module : torch.nn.Module
        Its buffers are read and written in place.

    Examples
    --------
    >>> bs = BufferSet(torch.nn.BatchNorm1d(3))
    >>> bs.size  # running_mean, running_var, num_batches_tracked
    7
    >>> BufferSet(torch.nn.Linear(2, 2)).gather() is None
    True
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.buffers = trained_buffers(module)
        self.size = sum(b.numel() for b in self.buffers)

    def __bool__(self) -> bool:
        return self.size > 0

    def gather(self) -> np.ndarray | None:
        """A new float64 copy of the buffers, or None for a module without any (nothing to send)."""
        if not self.size:
            return None
        with torch.no_grad():
            return torch.cat(
                [b.detach().reshape(-1).to(device="cpu", dtype=torch.float64) for b in self.buffers]
            ).numpy()

    def gather_here(self) -> torch.Tensor | None:
        """A new float64 copy of the buffers on their own device (no wait for a GPU), or None
        for a module without any. :meth:`gather` is the same on the host."""
        if not self.size:
            return None
        with torch.no_grad():
            return torch.cat([b.detach().reshape(-1).to(torch.float64) for b in self.buffers])

    def scatter(self, values: np.ndarray | torch.Tensor | None) -> None:
        """Copy ``values`` (from :meth:`gather`, here or elsewhere) into the buffers; None: no-op."""
        if values is None or not self.size:
            return
        # A copy: received frames may be read-only, which torch.from_numpy warns about.
        src = (values.detach().to(torch.float64) if isinstance(values, torch.Tensor)
               else torch.from_numpy(np.array(values, dtype=np.float64)))
        if src.numel() != self.size:
            raise ValueError(
                f"{src.numel()} buffer values for a module with {self.size}: they were saved for "
                "another model"
            )
        offset = 0
        with torch.no_grad():
            for b in self.buffers:
                n = b.numel()
                # copy_ casts back to the buffer's dtype: exact for the int64 counter (see above).
                b.copy_(src[offset : offset + n].view_as(b))
                offset += n
