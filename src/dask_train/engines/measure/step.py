"""What each way of running a job gets on one machine: its whole step, measured as it will run.

A cost model built from a bare gradient and optimizer step (``engines.measure.ps_costs``) misses what
the engines add on one machine: async-ps trainers share the shard's memory (its lock, and
cache lines that move between cores at every update), sync ranks wait for each other at every
sum, and one process pays neither. On the digits MLP that model predicted sync at 113,000
samples/s where it ran at 264,000, and async-ps at 524,000 where it ran at 343,000. So where
every worker is on one machine, ``strategy="auto"`` runs each candidate's real step for a few
tens of milliseconds, every process at once from the same moment:

* ``"one"``: one worker alone, a gradient and its own optimizer step (``FlatOptimizer`` on the
  model's parameters, as a one-rank sync job steps);
* ``"async"``: every worker at once on one shard in host memory (``ShardServer``, its
  ``apply(view=True)`` as a trainer of the host pushes), copying the parameters back;
* ``"sync"``: every worker at once, the gradients summed through host memory (``HostSum``, in
  lockstep) and the whole optimizer step on each.

Each returns its steps per second; the caller multiplies by the rows of a step. What none of
them runs (the feed's batches, the controller's bookkeeping, the scorer) costs every candidate
about the same per row.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import numpy as np
import torch

from dask_train.engines.holders import host_memory
from dask_train.engines.holders.host_memory import HostSegment
from dask_train.engines.holders.optim import FlatOptimizer
from dask_train.engines.measure.cores import prepared_step
from dask_train.models._flat import FlatModel
from dask_train.models._torch import batch_rows
from dask_train.policy._settings import OptimizerSettings

#: The ways of running a job this module measures (see the module's description).
MODES = ("one", "async", "sync")


def segment_path() -> str:
    """A new segment name for one measurement (``/dev/shm/dask-train-probe-...``)."""
    return host_memory.new_path("probe")


def candidate_rate_task(module: torch.nn.Module, x: np.ndarray, y: np.ndarray, *, mode: str,
                        loss: Any, optim: OptimizerSettings, rank: int, world: int,
                        path: str, start_at: float, duration_s: float, timeout: float) -> float:
    """Dask task: steps per second of ``mode``'s step on this worker (rank ``rank`` of
    ``world`` started together at ``start_at``, a ``time.time()`` every worker of one machine
    shares), for about ``duration_s``. Rank 0 creates the segment at ``path``; the others map
    it before the start."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: use one of {MODES}")
    model, loss_fn, xb, yb, grad = prepared_step(module, x, y, loss=loss)
    with contextlib.ExitStack() as held:
        # Created first by rank 0, so a peer that maps it finds the step's segment made too.
        ready = _Barrier(path + "-ready", rank=rank, world=world, timeout=timeout, held=held)
        if mode == "one":
            after: _After = _OwnStep(model, grad, optim)
        elif mode == "async":
            after = _SharedShard(model, grad, optim, rank=rank, path=path,
                                 start_at=start_at, timeout=timeout, held=held)
        else:
            after = _HostSumStep(model, grad, optim, rank=rank, world=world, path=path,
                                 start_at=start_at, timeout=timeout, held=held)
        rows = batch_rows(yb)  # several targets: a dict, whose len is its keys
        if mode != "sync":  # warm: the first step allocates (sync's rounds must match)
            model.gradient(xb, yb, loss_fn, out=grad)
            after.step(rows)
        time.sleep(max(0.0, start_at - time.time()))
        ready.wait()  # a peer slow to start (its first torch import) still starts with the rest
        steps, started = 0, time.perf_counter()
        while True:
            model.gradient(xb, yb, loss_fn, out=grad)
            after.step(rows)
            steps += 1
            elapsed = time.perf_counter() - started
            if after.done(elapsed >= duration_s):
                return steps / elapsed


class _After:
    """What follows a gradient in one way of running."""

    def step(self, rows: int) -> None:
        raise NotImplementedError

    def done(self, timed_out: bool) -> bool:
        """Whether to stop now, ``timed_out`` being this rank's time up."""
        return timed_out


class _OwnStep(_After):
    """One process: the optimizer steps the model's own parameters (as a one-rank sync job)."""

    def __init__(self, model: FlatModel, grad: torch.Tensor, optim: OptimizerSettings) -> None:
        self.own = FlatOptimizer(model.flat, optim, grad=grad)

    def step(self, rows: int) -> None:
        self.own.step(rows)


class _SharedShard(_After):
    """Async-ps on one machine: every trainer applies its push to one shard in host memory and
    copies the parameters back (as ``run_trainer`` does with a shard of its host)."""

    def __init__(self, model: FlatModel, grad: torch.Tensor, optim: OptimizerSettings, *,
                 rank: int, path: str, start_at: float, timeout: float,
                 held: contextlib.ExitStack) -> None:
        from dask_train.engines.holders.shard import ShardServer

        if rank == 0:
            shard = ShardServer(model.read_params(), optim)
            if not shard.to_host_memory(path, optim):
                raise RuntimeError("the probe's shard could not be put in host memory")
        else:
            shard = _wait_for(lambda: ShardServer.attach(path), start_at, timeout)
        held.callback(shard.close)
        self.model, self.grad, self.shard = model, grad, shard

    def step(self, rows: int) -> None:
        params, _, _ = self.shard.apply(self.grad.numpy(), rows, None, None, view=True)
        self.model.set_flat(params)


class _HostSumStep(_After):
    """Sync on one machine: the ranks' gradients summed through host memory, in lockstep, then
    the whole optimizer step on each. Every rank stops at the same round: rank 0, its time up,
    names the next round, which no peer can have passed (each round needs every rank)."""

    def __init__(self, model: FlatModel, grad: torch.Tensor, optim: OptimizerSettings, *,
                 rank: int, world: int, path: str, start_at: float, timeout: float,
                 held: contextlib.ExitStack) -> None:
        from dask_train.engines.collectives.host_sum import HostSum

        if rank == 0:
            seg = HostSegment.create(path, entries={
                "flags": ("int64", (1, 2, world)), "pids": ("int64", (world,)),
                "stop": ("int64", (1,)), "b0": ("float32", (2, world, model.n_params))},
                extra={})
        else:
            seg = _wait_for(lambda: HostSegment.attach(path), start_at, timeout)
        held.callback(seg.close)
        self.group = HostSum(seg, rank, world, 1, timeout, in_group=False)
        self.group.pids[rank] = os.getpid()
        held.push(self._abort_on_error)
        self.stop_at = seg.array("stop")
        self.own = FlatOptimizer(model.flat, optim, grad=grad)
        self.grad, self.rank, self.world = grad, rank, world

    def _abort_on_error(self, kind: Any, *_: Any) -> bool:
        if kind is not None:
            self.group.abort()  # the peers raise at once instead of waiting out the timeout
        return False

    def step(self, rows: int) -> None:
        self.group.start(0, self.grad).wait()
        self.grad.div_(self.world)
        self.own.step(rows * self.world)

    def done(self, timed_out: bool) -> bool:
        stop, at = self.stop_at, self.group.rounds[0]
        if self.rank == 0 and timed_out and not stop[0]:
            stop[0] = at + 1
        return bool(stop[0]) and at >= int(stop[0])


class _Barrier:
    """Every rank arrives before any starts: a flag per rank in a small segment."""

    def __init__(self, path: str, *, rank: int, world: int, timeout: float,
                 held: contextlib.ExitStack) -> None:
        if rank == 0:
            seg = HostSegment.create(path, entries={"arrived": ("int64", (world,))}, extra={})
        else:
            seg = _wait_for(lambda: HostSegment.attach(path), time.time(), timeout)
        held.callback(seg.close)
        self.arrived, self.rank, self.timeout = seg.array("arrived"), rank, timeout

    def wait(self) -> None:
        self.arrived[self.rank] = 1
        deadline = time.monotonic() + self.timeout
        while int(self.arrived.min()) == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the probe's ranks {np.flatnonzero(self.arrived == 0)} did "
                                   f"not start within {self.timeout:g} s")
            time.sleep(0.0005)


def _wait_for(make: Any, start_at: float, timeout: float) -> Any:
    """``make()`` once it returns something (the segment rank 0 creates), up to the start
    (plus ``timeout`` on a slow machine)."""
    deadline = max(start_at, time.time()) + timeout
    while True:
        got = make()
        if got is not None:
            return got
        if time.time() > deadline:
            raise TimeoutError("the probe's segment did not appear: rank 0 did not start")
        time.sleep(0.002)
