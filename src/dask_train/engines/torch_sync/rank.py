"""Synchronous data-parallel training: every rank steps together on the mean gradient.

Each rank runs in a Dask worker process whose default torch process group was started by
:func:`dask_train.start_torch`. Per step, the ranks' gradient sums, their sample counts and their
stop and pause votes travel in one flat buffer, all-reduced in buckets that start during the
backward pass (:class:`~dask_train.engines.collectives.reducer.GradientReducer`), so:

* the update is the exact mean gradient over the union of the ranks' batches, even when batches
  differ in size, and equals single-process training on the concatenated batches;
* a rank whose data ran out contributes zeros and keeps stepping with the others, so uneven
  blocks never deadlock an epoch's end (the job ends when every rank is out of data);
* a stop requested on any rank reaches all ranks at the same step;
* communication overlaps the backward pass of the earlier layers, as in DDP.

DistributedDataParallel itself is not used: it would need a second collective per step for the
counts and votes, and its ``join`` for uneven inputs. Every rank applies the same update with its
own optimizer, reading the reduced buffer in place, so parameters stay identical; rank 0 publishes its
parameters under index 0 of the job, where the shared scorer and the controller read them.

Module buffers (BatchNorm running statistics) change in every rank's forward pass from that rank's
own batches. After each step rank 0 broadcasts its buffers to the others, as DDP's
``broadcast_buffers`` does, and publishes them with its parameters (:class:`_BufferSync`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dask_train.checkpoint import read_slice
from dask_train.data._feed import batches
from dask_train.engines._spec import RoleConfig
from dask_train.engines.collectives.host_sum import HostSum
from dask_train.engines.collectives.reducer import META, GradientReducer
from dask_train.engines.harness.role import BlockCursor, TrainerRole, role_task
from dask_train.engines.harness.stats import StatsReporter
from dask_train.engines.holders.optim import FlatOptimizer
from dask_train.engines.holders.ref import ShardRef
from dask_train.models._buffers import BufferSet
from dask_train.models._flat import FlatModel
from dask_train.models._torch import batch_rows
from dask_train.runtime._torch_rank import rank_device

_END = object()  # a block with no batch left
#: Set to "1" in a worker's environment, its ranks step as on a GPU (losses checked with the
#: step's sums, updates queued before the counts are read) on the CPU too: how the tests run
#: that path where there is no GPU.
DEVICE_STEPS_ENV = "DASK_TRAIN_DEVICE_STEPS"


class _RankBatches:
    """A rank's batches across its blocks (read and reported by a :class:`BlockCursor`), the
    next one cut ahead and already on the model's device."""

    def __init__(self, cursor: BlockCursor, *, batch_size: int, model: Any,
                 steps: Callable[[], int]) -> None:
        self.cursor, self.batch_size, self.steps = cursor, batch_size, steps
        self.reader = cursor.reader
        self.model = model  # turns numpy batches into the model's tensors, on its device
        self.it: Iterator[tuple[Any, Any, Any]] | None = None
        # A batch cut ahead of time, as (rows, tensors) already on the model's device (or _END
        # when the block has none left); it counts as consumed only once next() hands it out,
        # so positions and resumes ignore it.
        self.ahead: tuple[int, Any] | object | None = None

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The next batch, or None once the feed has ended (or the job was stopped)."""
        while True:
            if self.it is not None:
                if self.ahead is None:
                    self.prefetch()
                batch, self.ahead = self.ahead, None
                if isinstance(batch, tuple):
                    rows, out = batch
                    self.cursor.take(rows)
                    return out  # type: ignore[no-any-return]
                self.close_block()
            item = self.cursor.next_block()
            if item is None:
                return None
            self.it = batches(item, self.batch_size)

    def prefetch(self) -> None:
        """Cut the current block's next batch now and start its copy to the model's device,
        to overlap them with the step's all-reduce (and, on a GPU, with its update)."""
        if self.it is not None and self.ahead is None:
            batch = next(self.it, _END)
            self.ahead = (len(batch[0]), self.model.batch(*batch)) if isinstance(batch, tuple) \
                else batch

    def close_block(self) -> None:
        """Report the current block (in full or in part) and forget it."""
        self.cursor.close_block(steps=self.steps())
        self.it, self.ahead = None, None

    def position(self) -> list[int] | None:
        """[epoch, block, rows consumed] of the block being read, None between blocks."""
        return self.cursor.position()


@role_task
def run_rank(
    module: torch.nn.Module,
    *,
    job: str,
    index: int,
    shards: Sequence[ShardRef],
    config: RoleConfig,
) -> dict[str, Any]:
    """Dask task: one rank of a synchronous job, until every rank is out of data or told to stop."""
    role = TrainerRole(job=job, index=index, config=config, kind="rank")
    if not dist.is_initialized() or dist.get_rank() != index:
        raise RuntimeError(
            f"rank {index} on {role.address} has no torch process group for it; "
            "start one with dt.start_torch on the job's workers"
        )
    device = rank_device(config.device_kind, config.device_for(role.address))
    model = role.model(module, device)
    model.train_mode()
    dist.broadcast(model.flat, src=0)  # identical start on every rank, whatever each unpickled
    reducer = GradientReducer(model)
    server = FlatOptimizer(model.flat, config.trains.optim, max_step=config.max_step,
                           grad=reducer.grad)
    restore = config.restore
    if restore is not None:
        # Every rank loads the same checkpoint: each applies the same updates with its own
        # optimizer, so each needs the optimizer state too, not only the parameters.
        state_ = read_slice(restore["files"], 0, model.n_params)
        server.restore(state_, version=restore["step"], samples=restore["samples"])
    buffers = _BufferSync(model.buffers(), server, rank=index, device=model.device)
    buffers.start(restored=restore is not None)
    # The scorer and the final pull read rank 0's parameters; every rank's stay readable on its
    # worker, so a survivor of a lost rank can write them (the engine's ``survivors``).
    role.state.params[0] = server

    feed = _RankBatches(BlockCursor(role), batch_size=config.batch_size, model=model,
                     steps=lambda: server.version)
    # Steps count from the restored step: the first report must not count those as its own.
    stats = role.stats(start={"steps": server.version})
    loop = _RankLoop(role, model, server, reducer, feed, buffers, stats)
    # Ranks all on one host sum their gradients in its memory, not over loopback sockets; CUDA
    # gradients stay with the group's own collectives (NCCL takes no host tensor).
    if model.device.type == "cpu":
        reducer.host = HostSum.join(reducer.spans, address=role.address, timeout=config.timeout)
    try:
        loop.run()
    except BaseException:
        if reducer.host is not None:
            reducer.host.abort()  # peers waiting on this rank's sum fail at once
        raise
    finally:
        host_memory_sum = reducer.host is not None
        reducer.close()
    feed.close_block()
    loop.report_stats(force=True)
    role.exit(steps=server.version)
    return role.result(steps=server.version, samples=loop.samples, allreduce_s=loop.comm_s,
                       host_memory_sum=host_memory_sum,
                       queued_updates=loop.queue_updates)


@dataclasses.dataclass(frozen=True)
class HeldPoint:
    """A rank's last applied step: its parameters' ``version`` (they and the optimizer state
    are the rank's holder, ``params[0]`` of its worker's job) and every rank's ``positions``
    after that step's batches (trainer -> ``[epoch, block, rows]`` or None; None as a whole
    when a position was too large to travel exactly)."""

    version: int
    positions: list[list[int] | None] | None


class _RankLoop:
    """A rank's steps: batches in, one all-reduce of gradients and votes, one update."""

    def __init__(self, role: TrainerRole, model: FlatModel, server: FlatOptimizer,
                 reducer: GradientReducer, feed: _RankBatches, buffers: _BufferSync,
                 stats: StatsReporter) -> None:
        self.role, self.model, self.server, self.reducer = role, model, server, reducer
        self.feed, self.buffers, self.stats = feed, buffers, stats
        self.loss_fn = model.loss_fn(role.config.trains.loss)
        self.comm_s, self.samples = 0.0, 0
        self.stop_vote = False
        # A model without autograd (Keras): its whole gradient comes from one GradientTape call,
        # so it is added into the reducer's buffer here and every bucket starts after the batches
        # (start_rest below): no overlap with the backward pass.
        self.scratch = None if isinstance(model, FlatModel) else torch.empty(model.n_params)
        # On a GPU, reading a loss on the host would wait for the device at every batch (a
        # plain loop doing so ran at 0.91x its speed on an H200): each rank counts its
        # non-finite losses on the device instead, that count travels with the step's sums,
        # and in the rare step with one every rank does the step again from the same batches,
        # checking each loss on the host (_reduce). The step's batches are kept for that.
        on_gpu = model.device.type == "cuda" or os.environ.get(DEVICE_STEPS_ENV) == "1"
        self.device_checks = self.scratch is None and on_gpu
        self.nonfinite = torch.zeros(1, device=model.device) if self.device_checks else None
        self.kept: list[tuple[Any, Any, Any]] = []
        # Where each kept batch came from ([epoch, block, rows] or None), for a loss report.
        self.kept_at: list[list[int] | None] = []
        # And the update is queued before the step's counts are read (a fused optimizer reads
        # the sample count and the skip flag on the device), so the device applies it while
        # the host reads them and queues the next forward (the 34M MLP on an H200: 0.88x plain
        # torch's speed when the update waited for the counts, 0.92x queued first).
        self.queue_updates = self.device_checks and model.scaler is None and \
            server.can_queue_steps

    def report_stats(self, *, force: bool = False) -> None:
        """Publish this rank's last second."""
        self.stats.report(step=self.server.version, force=force, samples=self.samples,
                          steps=self.server.version, feed_wait_s=self.feed.reader.wait_s,
                          server_wait_s=self.comm_s)

    def run(self) -> None:
        """Step with the other ranks until every rank is out of data, a stop, or the limit."""
        pauser = self.role.pauser
        while True:
            # float16 loss scaling: every rank uses the same scale (each sees the same reduced
            # sums and so makes the same overflow decisions).
            scale = self.model.scaler.scale if self.model.scaler is not None else 1.0
            count, (total, stops, pauses), queued = self._reduce(scale)
            self.samples += count
            self.report_stats()
            if total == 0 and stops == 0:  # every rank is out of data: the last epoch is done
                break
            at_limit = self._update(total, scale, queued)
            # Every rank's position at the step just applied, with the parameters it gave: what a
            # survivor hands on if a rank is lost (see HeldPoint).
            self.role.state.held = HeldPoint(self.server.version, self.reducer.positions)
            if stops > 0 or at_limit:
                break
            if pauses > 0:
                # Some rank was asked to pause: all pause after this same step, so the checkpoint
                # is one consistent state of every rank.
                if not pauser.pause(self.feed.position(), steps=self.server.version,
                                    pause_id=pauser.handled + 1):
                    break

    def _reduce(self, scale: float, again: list[tuple[Any, Any, Any]] | None = None
                ) -> tuple[int, tuple[float, float, float], bool]:
        """One step's batches (the feed's, or ``again``), reduced over the ranks: the samples
        this rank gave, the reduced ``(samples, stop votes, pause votes)``, and whether the
        step's update was queued on the device already (it applies unless no rank had a
        sample or some loss was not finite)."""
        reducer = self.reducer
        reducer.reset()
        count = self._accumulate(scale, again)
        reducer.start_rest()
        self.feed.prefetch()  # cut the next batch while the collectives run
        t0 = time.perf_counter()
        reducer.wait()
        self.comm_s += time.perf_counter() - t0
        queued = False
        if self.queue_updates:
            reducer.fetch_meta()
            # 0-d, as torch's steps count is: the kernel subtracts the flag from it.
            total_t, nonfinite_t = reducer.meta[0], reducer.meta[META - 1]
            skip = torch.logical_or(total_t <= 0, nonfinite_t > 0).float()
            queued = self.server.queue_step(total_t.clamp(min=1.0), skip)
        total, stops, pauses, nonfinite = reducer.meta_values()
        if nonfinite > 0:
            # A rank's loss was not finite, seen on its device: the sums hold its gradient.
            # Every rank (each read the same count) does the step again from the same batches,
            # checked on the host: the batch is left out, as on the CPU.
            return self._reduce(scale, list(self.kept))
        return count, (total, stops, pauses), queued

    def _accumulate(self, scale: float, again: list[tuple[Any, Any, Any]] | None = None) -> int:
        """This step's batches (the feed's, or ``again``) into the reducer's buffer (votes
        written before the last one's backward starts the all-reduce); the samples they hold."""
        every = self.role.config.trains.grad_accumulation
        on_device = self.device_checks and again is None
        if on_device:
            assert self.nonfinite is not None
            self.nonfinite.zero_()
            self.kept, self.kept_at = [], []
        # Again: the same batches first, then the feed's, as a left-out batch's place is
        # taken by the next one on the CPU.
        pending = iter(again or ())
        pending_at = iter(self.kept_at if again is not None else ())
        k, count, reduced = 0, 0, False
        while k < every:
            batch, at = next(pending, None), next(pending_at, None)
            if batch is None:
                batch = self.feed.next()
                at = self.feed.position()  # the block this batch was cut from
            if batch is None:
                break
            xb, yb, wb = batch
            rows = batch_rows(yb)  # several targets: a dict, whose len is its keys
            if self.scratch is not None:
                value = self.model.gradient(xb, yb, self.loss_fn, out=self.scratch, w=wb)
            else:
                loss = self.model.forward_loss(xb, yb, self.loss_fn, wb)
                if on_device:
                    assert self.nonfinite is not None
                    self.kept.append(batch)
                    self.kept_at.append(at)
                    self.nonfinite.add_(torch.logical_not(torch.isfinite(loss.detach())))
                    value = 0.0  # checked once the step's sums arrive (_reduce)
                else:
                    value = float(loss.detach())
            if not math.isfinite(value):
                # Left out of the step (a non-finite sum would poison every rank); counted
                # neither as samples nor as one of the k batches.
                epoch, block = (at[0], at[1]) if at is not None else (-1, -1)
                self.role.nans.report(loss=value, step=self.server.version, epoch=epoch,
                                      block=block)
                if self.role.config.on_nan == "stop":
                    self.stop_vote = True
                    break
                continue
            count += rows
            k += 1
            reduced = k == every  # the step's last batch: its backward starts the all-reduce
            if reduced:
                self._votes(count, on_device)
            # Scaled to the batch's sum, so the reduced mean weighs every sample equally, even
            # when the ranks' batches differ in size.
            if self.scratch is not None:
                self.reducer.grad.add_(self.scratch, alpha=rows * scale)
            else:
                self.reducer.backward(loss * (rows * scale), reduce=reduced)
        if not reduced:
            self._votes(count, on_device)
        return count

    def _update(self, total: float, scale: float, queued: bool) -> bool:
        """Apply the reduced mean gradient (count it, when ``queued`` on the device already);
        True at the step limit."""
        model, reducer, server = self.model, self.reducer, self.server
        if queued:
            if total <= 0:
                return False
            at_limit = server.count_step(int(total))
            self._applied(server.version)
            return at_limit
        if total > 0 and model.scaler is not None:
            reducer.grad.div_(scale)
            finite = bool(torch.isfinite(reducer.grad).all())
            model.scaler.update(finite)
            if not finite:  # an overflow of the scaled float16 gradients: skip this step
                total = 0.0
        if total <= 0:
            return False
        reducer.grad.div_(total)  # a non-finite batch was left out, so the mean is finite
        before = server.version
        at_limit = server.step(int(total))
        if server.version > before:
            self._applied(server.version)
        return at_limit

    def _applied(self, version: int) -> None:
        """After an applied step. Only then (every rank sees the same versions, so all ranks
        take part or none): a step refused at the limit must not publish the statistics of
        batches whose gradients were never applied."""
        if version == 1 and self.role.index == 0:
            self.role.started()  # the first step is applied: start-up ended (FitResult.timings)
        self.buffers.step()

    def _votes(self, count: int, on_device: bool) -> None:
        """Write this rank's samples and votes (and its non-finite losses counted on the
        device), before the collective that carries them starts."""
        self.reducer.set_meta(float(count), 1.0 if self.role.stopped() or self.stop_vote else 0.0,
                              1.0 if self.role.pauser.requested() else 0.0, self.feed.position(),
                              nonfinite=self.nonfinite if on_device else None)


class _BufferSync:
    """Keeps a model's buffers identical on every rank: rank 0's, broadcast after each step.

    Broadcast, not averaged (DDP's ``broadcast_buffers`` choice): one collective with no
    arithmetic, exact for the int64 ``num_batches_tracked`` counter, and the result is what DDP
    users expect. Every rank's running statistics are an average over its own recent batches;
    an average of those would not be the statistics of the union batch either (a mean of
    per-rank variances misses the spread between the ranks' means). Rank 0 also publishes them
    with its parameters for the scorer, the final pull and checkpoints. A model without buffers
    sends nothing.
    """

    def __init__(self, buffers: BufferSet, server: FlatOptimizer, *, rank: int,
                 device: torch.device) -> None:
        self.buffers, self.server, self.rank, self.device = buffers, server, rank, device
        # On the model's device: NCCL broadcasts device tensors only.
        self.received = torch.zeros(buffers.size, dtype=torch.float64, device=device) \
            if rank else None

    def start(self, *, restored: bool) -> None:
        """Load the checkpoint's buffers (every rank reads the same), else publish the module's."""
        if not self.buffers:
            return
        if restored and self.server.buffers is not None:
            self.buffers.scatter(self.server.buffers)
        elif self.rank == 0:
            self.server.set_buffers(self.buffers.gather())

    def step(self) -> None:
        """Broadcast rank 0's buffers after a step and publish them (rank 0)."""
        if not self.buffers:
            return
        # On the model's device: a GPU's buffers go to the host only when read (the holder's
        # buffers), never at each step.
        if self.rank == 0:
            values = self.buffers.gather_here()
            assert values is not None
            if dist.get_world_size() > 1:
                dist.broadcast(values, src=0)
            self.server.set_buffers(values)  # a new tensor each step: kept as is
        else:
            assert self.received is not None
            dist.broadcast(self.received, src=0)
            self.buffers.scatter(self.received)
            # Kept with this rank's parameters too: a survivor's state is written from them.
            self.server.set_buffers(self.received.clone())
