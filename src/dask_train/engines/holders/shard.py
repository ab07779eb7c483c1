"""A parameter-server shard's state: a flat slice, its optimizer, the pushes' counters and the
trainers' recent positions; in its server's process, or in host memory (:mod:`.host_memory`)
where every process of the host applies its own pushes.

The server (:mod:`dask_train.engines.ps.server`) creates it and serves remote pushes; a trainer
on the same host :meth:`~ShardServer.attach`\\ es to it and calls the same :meth:`apply`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dask_train.engines.harness.stats import StatsReporter
from dask_train.engines.holders import host_memory
from dask_train.engines.holders.host_memory import HostSegment
from dask_train.engines.holders.optim import FlatOptimizer
from dask_train.models._torch import OPTIMIZERS, build_optimizer
from dask_train.policy._settings import OptimizerSettings
from dask_train.runtime._processes import pid_alive

logger = logging.getLogger(__name__)

# Blocks per trainer whose applied rows a server remembers: more than a trainer can have between
# its last delivered event and its death (one being read plus those queued ahead).
_POSITIONS_KEPT = host_memory.BLOCKS_KEPT


class _NotShareable(Exception):
    """This optimizer's state cannot live in host memory (the shard stays in its process)."""


def _state_template(optim: OptimizerSettings) -> dict[str, tuple[str, str]]:
    """The optimizer's state entries: key -> (dtype, "param" or "scalar"), learned by one step
    of a two-element copy. Only built-ins whose fresh state is zeros (or made in ``__init__``,
    as Adagrad's) qualify: a state the first step fills otherwise could not be laid out ahead."""
    if not isinstance(optim.name, str) or optim.name not in OPTIMIZERS:
        raise _NotShareable(f"optimizer {optim.name!r} is not a built-in")
    if optim.name == "sgd" and float(optim.options.get("dampening", 0)) != 0:
        raise _NotShareable("SGD with dampening starts its momentum from the first gradient")
    probe = torch.nn.Parameter(torch.zeros(2))
    probe.grad = torch.zeros(2)
    opt = build_optimizer(optim, [probe])
    opt.step()
    template = {}
    for key, value in opt.state[probe].items():
        if not isinstance(value, torch.Tensor):
            raise _NotShareable(f"state {key!r} is not a tensor")
        kind = "param" if value.shape == (2,) else "scalar" if value.dim() == 0 else None
        if kind is None:
            raise _NotShareable(f"state {key!r} has shape {tuple(value.shape)}")
        template[key] = (str(value.dtype).removeprefix("torch."), kind)
    return template


def shareable(optim: OptimizerSettings) -> bool:
    """Whether this optimizer's state can live in host memory (else a shard stays in its
    server's process and trainers push to it)."""
    try:
        _state_template(optim)
    except _NotShareable:
        return False
    return True


class ShardServer(FlatOptimizer):
    """One parameter-server shard: applies gradients as they arrive (see :class:`FlatOptimizer`).

    It also remembers, per trainer, the rows of its last few blocks whose gradients it applied:
    after a trainer's loss the controller re-feeds exactly the rows the parameters have not
    seen, even when the trainer's last "block consumed" events died with it.

    In host memory (:meth:`to_host_memory`, :meth:`attach`) its parameters, optimizer state,
    counters, buffers and positions live in the segment, and its lock is the segment's.
    """

    host: HostSegment | None = None

    def __init__(self, params: np.ndarray | torch.Tensor, optim: OptimizerSettings,
                 **kwargs: Any) -> None:
        self._version = self._samples = 0
        self._buffers: np.ndarray | None = None
        self._positions: dict[int, dict[tuple[int, int], int]] = {}
        super().__init__(params, optim, **kwargs)
        self.push_secret = b""  # what a direct push connection must present
        self.stats: StatsReporter | None = None  # reports its updates once a second
        self.attached = False  # mapped from another process's segment
        self._owner_seen = 0.0  # when the server that made the segment was last seen alive
        # Held while this object's gradient buffer is filled and stepped: in host memory a
        # trainer's own push steps outside the segment's lock (see _apply_own).
        self._grad_lock = threading.Lock()

    # -- counters, buffers and positions: the segment's once in host memory -------------------

    @property  # type: ignore[override]
    def version(self) -> int:
        return self._version if self.host is None else int(self.host.header[host_memory.VERSION])

    @version.setter
    def version(self, value: int) -> None:
        if self.host is None:
            self._version = int(value)
        else:
            self.host.header[host_memory.VERSION] = int(value)

    @property  # type: ignore[override]
    def samples(self) -> int:
        return self._samples if self.host is None else int(self.host.header[host_memory.SAMPLES])

    @samples.setter
    def samples(self, value: int) -> None:
        if self.host is None:
            self._samples = int(value)
        else:
            self.host.header[host_memory.SAMPLES] = int(value)

    @property  # type: ignore[override]
    def buffers(self) -> np.ndarray | None:
        host = self.host
        if host is None:
            return self._buffers
        if not host.header[host_memory.HAS_BUFFERS]:
            return None
        return host.array("buffers").copy()  # a copy: callers keep it as is

    @buffers.setter
    def buffers(self, values: np.ndarray | torch.Tensor | None) -> None:
        if isinstance(values, torch.Tensor):
            values = values.cpu().numpy()
        host = self.host
        if host is None:
            self._buffers = values
        elif values is None:
            host.header[host_memory.HAS_BUFFERS] = 0
        elif host.array("buffers").size == np.size(values):
            host.array("buffers")[:] = values
            host.header[host_memory.HAS_BUFFERS] = 1

    @property
    def positions(self) -> dict[int, dict[tuple[int, int], int]]:
        """Trainer -> {(epoch, block): rows applied}, each trainer's recent blocks oldest first."""
        if self.host is None:
            return self._positions
        with self.host.locked():
            return self.host.positions()

    @property
    def in_host_memory(self) -> bool:
        return self.host is not None

    def _record(self, position: Sequence[int]) -> None:
        trainer, epoch, block, rows = (int(p) for p in position[:4])
        if self.host is not None:
            self.host.record(trainer, epoch, block, rows)
            return
        seen = self._positions.setdefault(trainer, {})
        seen[(epoch, block)] = rows
        if len(seen) > _POSITIONS_KEPT:
            del seen[next(iter(seen))]  # the oldest: dicts keep insertion order

    def _updating(self, samples: int, position: Sequence[int] | None = None
                  ) -> contextlib.AbstractContextManager[None]:
        # In host memory, a process lost inside the update leaves it to be completed.
        if self.host is None:
            return contextlib.nullcontext()
        return self.host.updating(samples, position)

    def _step(self, samples: int) -> None:
        with self._updating(samples):
            super()._step(samples)

    # -- pushes ---------------------------------------------------------------------------------

    def apply(
        self, grad: np.ndarray, samples: int, position: Sequence[int] | None = None,
        buffers: np.ndarray | None = None, *, view: bool = False,
    ) -> tuple[np.ndarray, int, bool]:
        """Apply one gradient; return (parameters, version, stop).

        The parameters are a copy taken under the lock, or with ``view`` (a trainer of this
        host, on a shard in host memory) the shard's own memory, which the trainer copies into
        its model at once, unlocked: see :mod:`.host_memory` for the staleness this allows.

        ``position`` is ``(trainer, epoch, block, rows)``: the pushing trainer's place in its data
        once this gradient is applied. ``buffers`` are the pusher's buffers (the first shard's
        pushes only carry them): the latest received replace the ones kept.

        Why the latest, not a mean: each trainer's running statistics are already an average
        (an exponential one over its recent batches), so averaging them again would double-average
        and lag; and the latest is what a single-process run would hold after its latest batch.
        """
        if view and self.host is not None:
            return self._apply_own(grad, samples, position, buffers)
        with self._grad_lock, self._lock:
            if self.at_limit():
                return self._params_out(), self.version, True
            # Copy into a grad buffer we own: received frames may be read-only.
            self.grad.numpy()[:] = grad
            version, stop = self._account(samples, position, buffers, step=True)
            return self._params_out(), version, stop

    def _apply_own(self, grad: np.ndarray, samples: int, position: Sequence[int] | None,
                   buffers: np.ndarray | None) -> tuple[np.ndarray, int, bool]:
        """A trainer of this host applies its own push to the shard in host memory: the
        bookkeeping under the segment's lock, the optimizer's arithmetic after it, unlocked, as
        Hogwild does (see :mod:`.host_memory`). Returns the shard's own memory."""
        with self._grad_lock:  # this object's threads share its parameter's .grad
            with self._lock:
                if self.at_limit():
                    return self.param.detach().numpy(), self.version, True
                # Counted before the arithmetic: a process lost in it has its rows applied once,
                # in part, never re-fed (as a torn update under the lock).
                version, stop = self._account(samples, position, buffers, step=False)
            # The optimizer reads the trainer's own gradient where it lies, not a copy: the
            # trainer does not touch it before this returns. A copy into this object's buffer
            # was 4% of a trainer's time on the 34M-parameter MLP (py-spy).
            if grad.flags.writeable and grad.flags.c_contiguous and grad.dtype == np.float32:
                self.param.grad = torch.from_numpy(grad)
            else:  # not a trainer's own buffer: copied, as a remote push is
                self.grad.numpy()[:] = grad
            try:
                self.optimizer.step()
            finally:
                self.param.grad = self.grad
        return self.param.detach().numpy(), version, stop

    def _account(self, samples: int, position: Sequence[int] | None,
                 buffers: np.ndarray | None, *, step: bool) -> tuple[int, bool]:
        """Count a push (under the lock), stepping the optimizer too with ``step``; return the
        version and whether the step limit is reached."""
        # The count and the position in one update: a loss between them would count rows
        # that the controller then re-feeds.
        with self._updating(samples, position):
            if step:
                super()._step(samples)
            else:
                self.version += 1
                self.samples += int(samples)
            if buffers is not None:
                # A copy: a received frame may be read-only or share memory with the message.
                self.buffers = np.array(buffers, dtype=np.float64)
            if position is not None:
                self._record(position)
        version, stop = self.version, self.at_limit()
        if self.stats is not None:  # here: pushes over RPC and local calls both apply
            self.stats.report(step=version, updates=version, samples=self.samples)
        return version, stop

    def _params_out(self) -> np.ndarray:
        return self.param.detach().numpy().copy()

    # -- host memory -------------------------------------------------------------------------------

    def to_host_memory(self, path: str, optim: OptimizerSettings) -> bool:
        """Move this shard's state into a new segment at ``path``; False (and the shard stays
        here) where that cannot be: an optimizer whose state cannot be laid out ahead, or no
        room in ``/dev/shm``."""
        try:
            template = _state_template(optim)
        except _NotShareable as exc:
            logger.debug("shard stays in its process: %s", exc)
            return False
        n = self.param.numel()
        held = self.optimizer.state.get(self.param, {})
        shapes = {k: (dtype, (n,) if kind == "param" else ()) for k, (dtype, kind) in
                  template.items()}
        buffers = self._buffers
        try:
            seg = HostSegment.create_shard(
                path, n=n, n_buffers=None if buffers is None else int(buffers.size),
                state=shapes, extra={"optimizer": optim.name, "lr": optim.lr,
                                         "options": dict(optim.options),
                       "max_step": self.max_step})
        except OSError as exc:
            logger.info("shard %s stays in its process: no room in host memory (%s)", path, exc)
            return False
        with self._lock:
            seg.array("params")[:] = self.param.detach().numpy()
            views = _state_views(seg)
            for key, view in views.items():
                if key in held:
                    view.copy_(held[key].reshape(view.shape))
            self.param.data = torch.from_numpy(seg.array("params"))
            self.optimizer.state[self.param] = views
            version, samples, positions = self._version, self._samples, self._positions
            self.host = seg
            self.version, self.samples, self.buffers = version, samples, buffers
            for trainer, seen in positions.items():
                for (epoch, block), rows in seen.items():
                    seg.record(trainer, epoch, block, rows)
            self._lock = _SegmentLock(seg)  # type: ignore[assignment]
        return True

    def server_gone(self) -> int | None:
        """On an attached shard: the process id of the server that made its segment when that
        process is gone, else None (looked at most every :data:`OWNER_CHECK_S`). A segment
        outlives its server: trainers that went on updating it would train, at full speed, on
        parameters that no one keeps, until the server's loss is decided."""
        now = time.monotonic()
        if not self.attached or self.host is None or now - self._owner_seen < OWNER_CHECK_S:
            return None
        pid = int(self.host.header[host_memory.OWNER])
        if pid_alive(pid):
            self._owner_seen = now
            return None
        return pid

    @classmethod
    def attach(cls, path: str) -> ShardServer | None:
        """This process's handle on the segment at ``path`` (another process's shard on this
        host); None when it is not here."""
        seg = HostSegment.attach(path)
        if seg is None:
            return None
        layout = seg.layout
        optim = OptimizerSettings(layout["optimizer"], float(layout["lr"]), layout["options"])
        shard = cls(torch.from_numpy(seg.array("params")), optim,
                    max_step=layout["max_step"])
        shard.optimizer.state[shard.param] = _state_views(seg)
        shard.host, shard.attached = seg, True
        shard._lock = _SegmentLock(seg)  # type: ignore[assignment]
        return shard

    def close(self) -> None:
        """Let the update thread end and, in host memory, release the segment (its creator
        removes the file)."""
        super().close()
        host = self.host
        if host is not None:
            # The tensors viewing the segment become copies first: a mapping with views left
            # cannot be closed, and kept the segment's memory and a descriptor until Python's
            # cycle collector freed this object (one per fit, per worker, between collections).
            with torch.no_grad():
                self.param.data = self.param.data.clone()
            state = self.optimizer.state.get(self.param)
            if state:
                self.optimizer.state[self.param] = {
                    k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            host.close()


#: How often a trainer on a shard in host memory looks whether the shard's server lives (s).
OWNER_CHECK_S = 0.01


class _SegmentLock:
    """The lock a shard in host memory takes where a plain one takes its thread lock."""

    def __init__(self, seg: HostSegment) -> None:
        self.seg = seg

    def __enter__(self) -> None:
        self.seg.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.seg.release()


def _state_views(seg: HostSegment) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(array) for key, array in seg.state_entries().items()}
