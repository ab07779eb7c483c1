"""Asynchronous parameter-server training: the trainer's loop, as worker code.

``run_trainer`` is submitted by the controller as a Dask task pinned to its role's worker
(``workers=[address]``, ``allow_other_workers=False``, ``pure=False`` because it has side effects
and must run once per call). It ``secede()``s from the worker's thread pool at once so that roles
sharing a process, and the feed tasks, never wait for a thread. The servers it pushes to are in
:mod:`dask_train.engines._ps_server`, the scorer every torch engine shares in
:mod:`dask_train.engines._scorer`.
"""

from __future__ import annotations

import collections
import copy
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from distributed import get_worker, secede

from dask_train.data._feed import FeedReader, batches
from dask_train.engines._ps_client import PSClient, ShardRef, write_params
from dask_train.engines._stats import StatsReporter
from dask_train.engines._worker import NanReporter, Pauser, rng_state, seed_trainer
from dask_train.models._buffers import BufferSet
from dask_train.models._torch import FlatModel, resolve_loss
from dask_train.runtime._plugin import worker_state


def run_trainer(
    module: torch.nn.Module,
    *,
    job: str,
    index: int,
    shards: Sequence[ShardRef],
    config: Mapping[str, Any],
) -> dict[str, Any]:
    """Dask task: one trainer's loop. Pull, compute gradients, push, until the feed ends or stop.

    Gradients of ``config["grad_accumulation"]`` batches are averaged into one push (one server
    update), never across a block boundary, so a block reported consumed is fully pushed. A batch
    whose loss is not finite is never pushed: it is skipped or stops the trainer (``on_nan``).
    """
    worker = get_worker()
    worker_state(worker).configure_torch()
    state = worker_state(worker).job(job)
    secede()
    role = f"worker-{index} on {worker.address}"
    seed_trainer(seed=config["seed"], index=index, saved=config.get("rng"))
    ps = PSClient(worker, job, state, shards, timeout=config["timeout"])
    model = FlatModel(copy.deepcopy(module))
    model.module.train()
    buffers = BufferSet(model.module)
    start = ps.pull()
    write_params(model.flat, start)
    # Start from the kept buffers too: after a resume, or when joining a running job, they carry
    # the statistics of every batch trained so far.
    buffers.scatter(start.buffers)
    pusher = _Pusher(ps, model, every=config["grad_accumulation"], depth=config["prefetch"],
                     buffers=buffers)
    loss_fn = resolve_loss(config["loss"])
    pauser = Pauser(worker, state, topic=config["topic"], trainer=index, timeout=config["timeout"])
    nans = NanReporter(worker, topic=config["topic"], trainer=index)
    stats = StatsReporter(worker, topic=config["topic"], role="trainer", index=index)
    pusher.version = start.version
    stopped = False

    def pause_idle() -> None:
        nonlocal stopped
        if pauser.requested():
            stopped = pusher.drain() or stopped
            if not pauser.pause(None, steps=pusher.pushes):
                stopped = True

    feed = FeedReader(state.feed(index), state.stop, timeout=config["timeout"], role=role,
                      on_idle=pause_idle)
    samples = 0
    started = time.perf_counter()
    feed_wait = 0.0
    while not stopped:
        t0 = time.perf_counter()
        item = feed.next()
        feed_wait += time.perf_counter() - t0
        if item is None or item.x is None:
            break
        consumed = 0
        for xn, yn in batches(item, config["batch_size"]):
            xb, yb = torch.from_numpy(xn), torch.from_numpy(yn)
            if state.stop.is_set() or stopped:
                stopped = True
                break
            pusher.position = [index, item.epoch, item.block, item.skip + consumed + len(xb)]
            stop, loss = pusher.add(xb, yb, loss_fn)
            if not math.isfinite(loss):
                nans.report(loss=loss, step=pusher.pushes, epoch=item.epoch, block=item.block)
                if config["on_nan"] == "stop":
                    stopped = True
                    break
            consumed += len(xb)
            stats.report(step=pusher.version, samples=samples + consumed, steps=pusher.pushes,
                         feed_wait_s=feed_wait, server_wait_s=pusher.wait_s)
            if stop:
                stopped = True
                break
            if pusher.count == 0 and pauser.requested():
                # A consistent point: nothing half-accumulated; drain the pushes in flight.
                stopped = pusher.drain()
                position = [item.epoch, item.block, item.skip + consumed]
                if not pauser.pause(position, steps=pusher.pushes) or stopped:
                    stopped = True
                    break
        stopped = pusher.flush() or stopped
        samples += consumed
        worker.log_event(
            config["topic"],
            {"kind": "block", "trainer": index, "epoch": item.epoch, "block": item.block,
             "rows": consumed, "done": item.skip + consumed == item.rows, "steps": pusher.pushes},
        )
    pusher.drain()
    stats.report(step=pusher.version, force=True, samples=samples, steps=pusher.pushes,
                 feed_wait_s=feed_wait, server_wait_s=pusher.wait_s)
    # The last event: once the controller has it, it has every block report sent before it.
    worker.log_event(config["topic"], {"kind": "exit", "trainer": index, "steps": pusher.pushes})
    # Where the trainer's time went, so a slow job says whether it waited for data or servers.
    return {
        "trainer": index, "steps": pusher.pushes, "samples": samples, "worker": worker.address,
        "busy_s": time.perf_counter() - started, "feed_wait_s": feed_wait,
        "ps_wait_s": pusher.wait_s, "nonfinite": nans.count, "rng": rng_state(),
    }


class _Pusher:
    """Averages the gradients of ``every`` batches and pushes them, keeping ``depth`` in flight.

    With ``depth`` d > 0, up to d pushes travel while the next gradients are computed on the
    parameters received after an earlier update: d updates of extra staleness bought for
    overlapping communication with computation. With 0 the trainer is a plain sequential loop.
    """

    def __init__(
        self, ps: PSClient, model: FlatModel, *, every: int, depth: int, buffers: BufferSet
    ) -> None:
        self.ps, self.model, self.every, self.depth = ps, model, every, depth
        # Sent with every push (a new small array each time, so one in flight is never
        # rewritten); the replies do not bring them back: this trainer's running statistics go
        # on from its own batches, which a reply computed before them would overwrite.
        self.bufset = buffers
        # A buffer being filled plus one per push in flight: a push's buffer is never rewritten
        # while it is still being sent.
        self.buffers = [torch.empty(model.n_params) for _ in range(depth + 1)]
        self.scratch = torch.empty(model.n_params) if every > 1 else None
        self.count = self.samples = self.pushes = 0
        self.pending: collections.deque[Any] = collections.deque()
        self.wait_s = 0.0
        self.version = 0  # the servers' update count in the latest reply (the job's step)
        self.position: list[int] | None = None  # sent with the next push

    def add(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Any) -> tuple[bool, float]:
        """Add one batch's gradient; push when ``every`` are in.

        Returns (stop, loss): stop is True when the servers say stop. A batch with a non-finite
        loss is left out (nothing accumulated); the caller decides to skip or stop.
        """
        grad = self.buffers[self.pushes % len(self.buffers)]
        target = grad if self.count == 0 else self.scratch
        assert target is not None
        loss = self.model.gradient(x, y, loss_fn, out=target)
        if not math.isfinite(loss):
            return False, loss
        if self.count > 0:
            grad.add_(target)
        self.count += 1
        self.samples += len(x)
        return (self.flush() if self.count == self.every else False), loss

    def flush(self) -> bool:
        """Push the mean of the gradients gathered so far, if any."""
        if self.count == 0:
            return False
        grad = self.buffers[self.pushes % len(self.buffers)]
        if self.count > 1:
            grad.div_(self.count)
        stop = False
        while len(self.pending) >= max(self.depth, 1):
            stop = self._receive() or stop
        self.pending.append(self.ps.push(grad, self.samples, self.position, self.bufset.gather()))
        self.pushes += 1
        self.count = self.samples = 0
        if self.depth == 0:
            stop = self._receive() or stop
        return stop

    def drain(self) -> bool:
        """Wait for every push in flight and load the parameters they brought back."""
        stop = False
        while self.pending:
            stop = self._receive() or stop
        return stop

    def _receive(self) -> bool:
        t0 = time.perf_counter()
        exchange = self.ps.wait(self.pending.popleft())
        self.wait_s += time.perf_counter() - t0
        self.version = exchange.version
        write_params(self.model.flat, exchange)
        return exchange.stop
