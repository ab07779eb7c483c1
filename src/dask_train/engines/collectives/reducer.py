"""Bucketed gradient all-reduce that overlaps the backward pass, for the sync strategy.

Every trainable parameter's ``.grad`` is a view into one flat buffer, so autograd accumulates
straight into the memory that is reduced: no gather into a flat tensor, no copy into the
optimizer's gradient. The buffer is cut into buckets in reverse parameter order (the order in
which backward produces gradients). A bucket's all-reduce starts, asynchronously, as soon as the
last of its gradients is accumulated, while backward goes on computing the earlier layers; the
step then waits for all of them. This is what DistributedDataParallel does in C++; here it is kept
in Python because the same collectives also carry the step's sample count and the ranks' stop and
pause votes, which DDP would need a second collective for.

Collectives are matched by their order on every rank, so buckets are always started in index
order: a bucket whose gradients are ready waits for the buckets before it, and a rank with no
backward this step (out of data, a non-finite loss) starts the same buckets in the same order
over its zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dask_train.models._flat import FlatModel

#: Values carried in front of the gradients: [samples, stop votes, pause votes, non-finite
#: losses], then one slot of :data:`POSITION` values per rank (:func:`meta_size`).
META = 4
#: A rank's data position after the step's batches, ``[epoch + 1, block, rows]`` (zeros between
#: blocks), in its own slot: once reduced, every rank knows where every rank was at each step it
#: applied, so a survivor of a lost rank holds a consistent state to go on from (parameters,
#: optimizer and every rank's position) without a stored checkpoint.
POSITION = 3
#: float32 holds integers exactly up to 2**24: a larger position is not kept (no in-memory point).
_EXACT = float(1 << 24)


def meta_size(world: int) -> int:
    """Values in front of the gradients for a group of ``world`` ranks."""
    return META + POSITION * world
#: Bucket size. DDP uses 1 MB for its first bucket and 25 MB after; on CPU with gloo, where
#: compute and communication share the cores, smaller buckets start the traffic earlier.
BUCKET_BYTES = 1 << 20
#: On gloo, buckets up to this size are summed from an all-gather instead of all-reduced: for 2
#: ranks on loopback an all-gather of 28 KB took 0.6-0.85 ms against 1.3-1.6 ms for gloo's
#: all_reduce (280 KB: 1.4 against 2.1 ms). Every rank adds the gathered tensors in rank order,
#: so all ranks get bitwise the same sum, as with an all-reduce.
GATHER_BYTES = 256 << 10


class _GatherSum:
    """An all-reduce (sum) of a small tensor as an all-gather plus a local sum in rank order."""

    def __init__(self, data: torch.Tensor, parts: list[torch.Tensor]) -> None:
        self.data, self.parts = data, parts
        self.work = dist.all_gather(parts, data, async_op=True)

    def wait(self) -> None:
        self.work.wait()
        torch.add(self.parts[0], self.parts[1], out=self.data)
        for part in self.parts[2:]:
            self.data.add_(part)


class _Alone:
    """The collective of a group of one rank: its buffer already holds the sum."""

    def wait(self) -> None:
        """Nothing to wait for."""


class GradientReducer:
    """A flat ``[meta | gradients]`` buffer reduced across ranks in buckets during backward.

    Parameters
    ----------
    model : FlatModel
        Its parameters' ``.grad`` become views into :attr:`grad`.
    bucket_bytes : int
        Target bucket size in bytes (a bucket holds whole parameters, so one can be larger).
    """

    def __init__(self, model: FlatModel, *, bucket_bytes: int = BUCKET_BYTES) -> None:
        world = dist.get_world_size()
        self.rank, head = dist.get_rank(), meta_size(world)
        self.buf = torch.zeros(head + model.n_params, device=model.flat.device)
        self.meta = self.buf[:head]
        # On the CPU the meta is read and written through numpy (see meta_values). On a GPU it
        # is written from pinned memory, whose copy is queued without waiting for the device
        # (a copy from pageable memory waits for the device's queue to drain).
        on_cpu = self.buf.device.type == "cpu"
        self._meta_host = self.meta.numpy() if on_cpu else None
        self._stage = None if on_cpu else torch.zeros(head, pin_memory=True)
        self._staged: Any = None  # the event of the stage's last copy
        # Where fetch_meta copies the reduced meta on the host, and the event of that copy.
        self._fetch = None if on_cpu else torch.zeros(head, pin_memory=True)
        self._fetched: Any = None
        self._slot = META + POSITION * self.rank
        #: Every rank's position at the last reduced step (:meth:`meta_values`).
        self.positions: list[list[int] | None] | None = None
        self.grad = self.buf[head:]
        self._params = model.params
        offsets, offset = [], 0
        for p in self._params:
            p.grad = self.grad[offset : offset + p.numel()].view_as(p)
            offsets.append(offset)
            offset += p.numel()
        # Buckets over parameter indices, last parameter first; bucket -> (start, end) in buf.
        limit = max(1, bucket_bytes // self.buf.element_size())
        self._bucket_of: dict[int, int] = {}  # id(parameter) -> its bucket
        self._spans: list[tuple[int, int]] = []
        members: list[list[int]] = []
        filled = limit
        for i in reversed(range(len(self._params))):
            if filled >= limit:
                members.append([])
                filled = 0
            members[-1].append(i)
            filled += self._params[i].numel()
        for b, idx in enumerate(members):
            start, end = offsets[min(idx)], offsets[max(idx)] + self._params[max(idx)].numel()
            # The bucket that holds the first parameter is reduced last: it carries the meta.
            self._spans.append((0 if min(idx) == 0 else head + start, head + end))
            for i in idx:
                self._bucket_of[id(self._params[i])] = b
        self._sizes = [len(idx) for idx in members]
        # One rank (strategy="auto"'s one process): no collective at all, not even gloo's.
        self._alone = world == 1
        gather = dist.get_backend() == "gloo" and world > 1
        # Receive buffers for the small buckets, allocated once.
        self._parts: list[list[torch.Tensor] | None] = [
            [torch.empty(end - start, device=self.buf.device) for _ in range(world)]
            if gather and (end - start) * self.buf.element_size() <= GATHER_BYTES else None
            for start, end in self._spans
        ]
        self._pending: list[int] = []
        self._works: list[Any] = []
        self._armed = False
        #: Sums the buckets through host memory instead of gloo (``host_sum.HostSum``), if set.
        self.host: Any = None
        # Kept to be removed by close(): a hook lives in the parameter's C++ autograd data, out of
        # Python's cycle collector, so parameter -> hook -> reducer -> parameter was never freed,
        # and with it the host-memory sum's mapping and its descriptor (one per fit, per worker).
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]
        self.reset()

    def close(self) -> None:
        """Remove the gradient hooks and unmap the host-memory sum: the parameters, the model
        and the segment are freed with the rank's last reference to them."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.host is not None:
            self.host.close()

    def set_meta(self, samples: float, stop: float, pause: float,
                 position: Sequence[int] | None = None, *,
                 nonfinite: torch.Tensor | None = None) -> None:
        """This rank's step samples, votes and data position (``[epoch, block, rows]`` after
        the step's batches, None between blocks), before the collective that carries them;
        ``nonfinite``, a one-element tensor on the buffer's device, counts the losses found not
        finite there (none when None)."""
        where = (0.0, 0.0, 0.0) if position is None else \
            (position[0] + 1.0, float(position[1]), float(position[2]))
        if self._meta_host is not None:
            # A torch scalar index costs a few microseconds each; a rank's loop does seven a step.
            self._meta_host[:META] = (samples, stop, pause, 0.0)
            self._meta_host[self._slot : self._slot + POSITION] = where
        else:
            assert self._stage is not None
            if self._staged is not None:
                self._staged.synchronize()  # the last copy is done with the stage (it is, always)
            stage = self._stage.numpy()
            stage[:] = 0.0
            stage[:META] = (samples, stop, pause, 0.0)
            stage[self._slot : self._slot + POSITION] = where
            self.meta.copy_(self._stage, non_blocking=True)
            self._staged = torch.cuda.Event()
            self._staged.record()
        if nonfinite is not None:
            self.meta[META - 1 : META].copy_(nonfinite)

    def fetch_meta(self) -> None:
        """On a GPU: queue the reduced meta's copy to the host now (after :meth:`wait`), so
        that :meth:`meta_values` waits for that copy only, not for work queued after it (the
        step's update)."""
        if self._fetch is not None:
            self._fetch.copy_(self.meta, non_blocking=True)
            self._fetched = torch.cuda.Event()
            self._fetched.record()

    def meta_values(self) -> tuple[float, float, float, float]:
        """The reduced ``(samples, stop votes, pause votes, non-finite losses)`` of the step;
        every rank's position goes to :attr:`positions` (None when one is too large to be
        exact)."""
        if self._fetched is not None:
            assert self._fetch is not None
            self._fetched.synchronize()
            self._fetched = None
            values = self._fetch.tolist()
        else:
            values = (self.meta if self._meta_host is None else self._meta_host).tolist()
        slots = [values[i : i + POSITION] for i in range(META, len(values), POSITION)]
        self.positions = None if any(v >= _EXACT for v in values[META:]) else [
            None if slot[0] == 0 else [int(slot[0]) - 1, int(slot[1]), int(slot[2])]
            for slot in slots]
        return values[0], values[1], values[2], values[3]

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Each bucket's (start, end) in the ``[meta | gradients]`` buffer, in launch order."""
        return list(self._spans)

    @property
    def n_buckets(self) -> int:
        """Number of collectives per step."""
        return len(self._spans)

    def reset(self) -> None:
        """Zero the buffer for the next step (the previous step's collectives must be done)."""
        self.buf.zero_()
        self._pending = list(self._sizes)
        self._works = []
        self._armed = False

    def backward(self, loss: torch.Tensor, *, reduce: bool) -> None:
        """Accumulate ``loss``'s gradients; with ``reduce``, start the buckets as they fill."""
        self._armed = reduce
        try:
            loss.backward()
        finally:
            self._armed = False

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        b = self._bucket_of[id(param)]
        self._pending[b] -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while len(self._works) < len(self._spans) and self._pending[len(self._works)] <= 0:
            b = len(self._works)
            start, end = self._spans[b]
            parts = self._parts[b]
            if self._alone:
                self._works.append(_Alone())
            elif self.host is not None:
                self._works.append(self.host.start(b, self.buf[start:end]))
            elif parts is not None:
                self._works.append(_GatherSum(self.buf[start:end], parts))
            else:
                self._works.append(dist.all_reduce(self.buf[start:end], async_op=True))

    def start_rest(self) -> None:
        """Start every bucket not started yet: all of them when no backward reduced this step."""
        for b in range(len(self._works), len(self._spans)):
            self._pending[b] = 0
        self._launch_ready()

    def wait(self) -> None:
        """Wait for every bucket's collective; the buffer then holds the sums over all ranks."""
        for work in self._works:
            work.wait()
