"""``ctx.prepare``'s data-parallel model when every rank of a ``dt.run`` job is on one host.

Why not DistributedDataParallel there: on one machine gloo goes through loopback sockets, and
DDP's own Python machinery per step (its forward's bookkeeping and, for uneven shares, ``Join``'s
extra all-reduce every step) cost more than the gradient sum itself. A py-spy profile of the
digits MLP's rank showed 27% of the step in ``DistributedDataParallel.forward`` (9% of it
``Join``'s per-step all-reduce). Here the ranks average through one segment of the host's memory
(:class:`~dask_train.engines.collectives.host_sum.HostSum`, the sync Trainer's sum) and nothing
else happens per step: the model's forward is the module's own.

What DDP does, this does too:

* every rank starts from rank 0's parameters and buffers (frozen ones too);
* at the end of every ``backward`` the gradients are averaged over the ranks (divided by the
  number of ranks; every rank adds the slots in rank order, so all get bitwise the same mean);
  a parameter without a gradient on a rank counts as zeros there, and one without a gradient
  on every rank keeps ``grad=None``;
* floating-point buffers (BatchNorm's running statistics) are taken from the lowest active
  rank at every step, as DDP broadcasts them from rank 0 before each forward;
* ``no_sync()`` accumulates gradients locally until the next backward outside it;
* uneven shares never hang: a rank whose share of an epoch ran out takes part in the others'
  sums with zeros until every share is read, then every rank takes the parameters of the rank
  that stepped last, as DDP does under ``Join`` (``divide_by_initial_world_size``).

Every model one context prepares shares one sum: a step's sum holds all of them, so the ranks'
sums always match, whichever model a ``backward`` went through (a GAN's two models). Averaging
a gradient that is already equal on every rank leaves it as it is, so a model a ``backward``
did not reach is not changed by it beyond a rounding.

Where this does not apply (a GPU, ranks on several hosts, parameters that are not float32 on
the CPU, sparse gradients, ``ddp_options`` given, ``dask-train.host-memory`` off)
``ctx.prepare`` returns torch's ``DistributedDataParallel`` over the job's process group.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from dask_train.engines.collectives.host_sum import HostSum

logger = logging.getLogger(__name__)


def eligible(model: torch.nn.Module, device: torch.device, ddp_options: dict[str, Any]) -> bool:
    """Whether ``model`` can be averaged through host memory (the rest of the test is
    :meth:`HostGroup.join`'s: every rank on one host, the segment mapped)."""
    if ddp_options or device.type != "cpu":
        return False
    if any(getattr(m, "sparse", False) is True for m in model.modules()):
        return False  # sparse gradients (an Embedding's sparse=True): DDP reduces them
    return all(p.dtype == torch.float32 for p in model.parameters()) and any(
        p.requires_grad for p in model.parameters())


class HostGroup:
    """The models one rank prepared and the sum they share (one per :class:`RunContext`).

    Layout of a round, in float32: ``[active (world) | has a gradient (tensors) | gradients |
    buffers (world x buffer elements)]``. ``active`` says which ranks stepped; a broadcast round
    puts the source's parameters where the gradients go.
    """

    def __init__(self, *, rank: int, world: int, address: str, timeout: float) -> None:
        self.rank, self.world, self.address, self.timeout = rank, world, address, timeout
        self.modules: list[torch.nn.Module] = []
        self.params: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor] = []
        self.host: HostSum | None = None
        self.flat = torch.zeros(0)
        self.marks = self.flat.numpy()
        self.sync = True  # False inside no_sync()
        self._queued = False
        self.last_active: list[int] = []  # the ranks active in the newest round with any
        self.grad_size = self.buffer_size = 0
        # Removed by close(): a hook lives in the parameter's C++ autograd data, out of Python's
        # cycle collector (parameter -> hook -> group -> parameter is never freed otherwise).
        self._hooks: list[Any] = []

    # -- setting up (collective: every rank prepares the same models in the same order) -------------
    def join(self, module: torch.nn.Module) -> bool:
        """Add ``module`` to the group and start it from rank 0's state; False (on every rank)
        where the ranks cannot share a segment of one host's memory."""
        known = {id(t) for t in self.params + self.buffers}
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in known]
        buffers = [b for b in module.buffers() if id(b) not in known
                   and (b.is_floating_point() or b.dtype == torch.int64)]
        grads = sum(p.numel() for p in self.params + params)
        size = self.world + len(self.params) + len(params) + grads + self.world * sum(
            b.numel() for b in self.buffers + buffers)
        host = HostSum.join([(0, size)], address=self.address, timeout=self.timeout)
        if host is None:
            return False
        if self.host is not None:
            self.host.close()
        self.host, self.flat = host, torch.zeros(size)
        self.marks = self.flat.numpy()  # the same memory: scalars read and written cheaply
        self.modules.append(module)
        self.params += params
        self.buffers += buffers
        # Sizes read every step: counted once here.
        self.grad_size = sum(p.numel() for p in self.params)
        self.buffer_size = sum(b.numel() for b in self.buffers)
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        # Rank 0's whole state, frozen parameters and integer buffers too, as DDP's constructor
        # broadcasts it: once, so over the process group.
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                torch.distributed.broadcast(tensor.data, src=0)
        return True

    # -- a step ---------------------------------------------------------------------------------------
    def _on_grad(self, _param: torch.Tensor) -> None:
        if self.sync and not self._queued:
            self._queued = True
            # After the whole backward: one sum of every gradient, as DDP's last bucket ends it.
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._queued = False
        self.step_round(active=True)

    def step_round(self, *, active: bool) -> bool:
        """One sum of the ranks' gradients (this rank's zeros when not ``active``); whether any
        rank was active."""
        flat, marks, world, k = self.flat, self.marks, self.world, len(self.params)
        flat.zero_()
        if active:
            marks[self.rank] = 1.0
            grads = flat[world + k:]
            offset = 0
            for i, p in enumerate(self.params):
                n = p.numel()
                if p.grad is not None:
                    marks[world + i] = 1.0
                    grads[offset:offset + n].copy_(p.grad.reshape(-1))
                offset += n
            self._put_buffers(world + k + offset)
        assert self.host is not None
        self.host.start(0, flat).wait()
        who = [r for r in range(world) if marks[r] > 0]
        if not who:
            return False
        self.last_active = who
        flat[world + k:world + k + self.grad_size].div_(world)
        offset = world + k
        for i, p in enumerate(self.params):
            n = p.numel()
            if marks[world + i] > 0:
                mean = flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = mean.clone()
                else:
                    p.grad.copy_(mean)
            offset += n
        self._take_buffers(offset, src=who[0])
        return True

    def _put_buffers(self, start: int) -> None:
        offset = start + self.rank * self.buffer_size
        for b in self.buffers:
            self.flat[offset:offset + b.numel()].copy_(b.detach().reshape(-1))
            offset += b.numel()

    def _take_buffers(self, start: int, *, src: int) -> None:
        offset = start + src * self.buffer_size
        with torch.no_grad():
            for b in self.buffers:
                b.copy_(self.flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()

    def _broadcast(self, src: int) -> None:
        """Every rank takes rank ``src``'s parameters and buffers (a round of its own)."""
        flat, world, k = self.flat, self.world, len(self.params)
        flat.zero_()
        start = world + k
        offset = start
        if self.rank == src:
            for p in self.params:
                flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                offset += p.numel()
            self._put_buffers(start + self.grad_size)
        assert self.host is not None
        self.host.start(0, flat).wait()
        offset = start
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self._take_buffers(offset, src=src)

    # -- uneven shares ----------------------------------------------------------------------------------
    def shadow(self) -> None:
        """This rank's share of the epoch is read: join the others' sums with zeros until every
        rank's is, then take the model of the rank that stepped last (collective)."""
        everyone = list(range(self.world))
        while self.step_round(active=False):
            pass
        if self.last_active and self.last_active != everyone:
            self._broadcast(self.last_active[0])
        self.last_active = everyone

    def abort(self) -> None:
        """Release the peers waiting in a sum for this rank (its own code raised)."""
        if self.host is not None:
            self.host.abort()

    def close(self) -> None:
        """Remove the gradient hooks and unmap the segment."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.host is not None:
            self.host.close()
            self.host = None


class HostDataParallel(torch.nn.Module):
    """A module whose gradients are averaged over the ranks of one host (see the module's
    description); ``.module`` is the model itself, as with DistributedDataParallel."""

    def __init__(self, module: torch.nn.Module, group: HostGroup) -> None:
        super().__init__()
        self.module = module
        # Not an attribute torch tracks: the group is not part of the model's state.
        object.__setattr__(self, "_group", group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next ``backward`` outside averages them all (as
        DDP's ``no_sync``; it covers every model this rank prepared)."""
        group: HostGroup = object.__getattribute__(self, "_group")
        before, group.sync = group.sync, False
        try:
            yield
        finally:
            group.sync = before


class OneRank(torch.nn.Module):
    """The face of a data-parallel wrapper on a job's only rank: ``.module``, ``forward`` and
    ``no_sync()`` as with DistributedDataParallel, nothing to average. For a job that may run
    on more ranks (``workers=(1, n)``): its code reaches ``model.module`` whatever its size
    (a departure can leave it one rank; ``ctx.prepare`` returned the bare model then, and
    ``model.module.state_dict()`` in the loop failed the job)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Nothing to hold back with one rank (DDP's ``no_sync``)."""
        yield
