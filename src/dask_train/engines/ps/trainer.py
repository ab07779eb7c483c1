"""Asynchronous parameter-server training: the trainer's loop, as worker code.

``run_trainer`` is submitted by the controller as a Dask task pinned to its role's worker
(``workers=[address]``, ``allow_other_workers=False``, ``pure=False`` because it has side effects
and must run once per call). It ``secede()``s from the worker's thread pool at once so that roles
sharing a process, and the feed tasks, never wait for a thread. The servers it pushes to are in
:mod:`dask_train.engines.ps.server`, the scorer every torch engine shares in
:mod:`dask_train.engines.scoring.scorer`.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from dask_train.data._feed import FeedItem, batches
from dask_train.engines._spec import RoleConfig
from dask_train.engines.harness.role import BlockCursor, TrainerRole, role_task
from dask_train.engines.holders.params import PSClient, ShardRef, write_params
from dask_train.models._buffers import BufferSet
from dask_train.models._flat import FlatModel
from dask_train.models._torch import batch_rows


@role_task
def run_trainer(
    module: torch.nn.Module,
    *,
    job: str,
    index: int,
    shards: Sequence[ShardRef],
    config: RoleConfig,
) -> dict[str, Any]:
    """Dask task: one trainer's loop. Pull, compute gradients, push, until the feed ends or stop.

    Gradients of ``config.trains.grad_accumulation`` batches are averaged into one push (one server
    update), never across a block boundary, so a block reported consumed is fully pushed. A batch
    whose loss is not finite is never pushed: it is skipped or stops the trainer (``on_nan``).
    """
    role = TrainerRole(job=job, index=index, config=config)
    ps = PSClient(role.worker, job, role.state, shards, timeout=config.timeout,
                  secret=config.push_secret)
    try:
        model = role.model(module)
        model.train_mode()
        buffers = model.buffers()
        start = ps.pull()
        write_params(model, start)
        # Start from the kept buffers too: after a resume, or when joining a running job, they
        # carry the statistics of every batch trained so far.
        buffers.scatter(start.buffers)
        pusher = _Pusher(ps, model, every=config.trains.grad_accumulation,
                         depth=config.trains.prefetch, buffers=buffers)
        pusher.version = start.version
        loop = _TrainerLoop(role, model, pusher)
        loop.run()
        pusher.drain()
        host_shards = ps.in_host_memory()
    finally:
        ps.close()  # connections and mapped shards, also when the trainer fails or is lost
    loop.report_stats(force=True)
    role.exit(steps=pusher.pushes)
    return role.result(steps=pusher.pushes, samples=loop.cursor.samples,
                       feed_wait_s=loop.cursor.reader.wait_s,
                       ps_wait_s=pusher.wait_s, prefetch=pusher.depth,
                       host_memory_shards=host_shards)


class _TrainerLoop:
    """A trainer's blocks, batches, pushes and pauses (see :func:`run_trainer`)."""

    def __init__(self, role: TrainerRole, model: FlatModel, pusher: _Pusher) -> None:
        self.role, self.model, self.pusher = role, model, pusher
        self.loss_fn = model.loss_fn(role.config.trains.loss)
        self.stats = role.stats()
        self.stopped = False
        self.cursor = BlockCursor(role, on_idle=self._pause_idle)

    def report_stats(self, *, force: bool = False) -> None:
        """Publish this trainer's last second."""
        self.stats.report(step=self.pusher.version, force=force, samples=self.cursor.samples,
                          steps=self.pusher.pushes, feed_wait_s=self.cursor.reader.wait_s,
                          server_wait_s=self.pusher.wait_s)

    def _pause_idle(self) -> None:
        """A pause asked for while the trainer waits for a block: between blocks, no position."""
        if self.role.pauser.requested():
            self.stopped = self.pusher.drain() or self.stopped
            if not self.role.pauser.pause(None, steps=self.pusher.pushes):
                self.stopped = True

    def run(self) -> None:
        """Train on every block the feed brings, until it ends or the job stops."""
        while not self.stopped:
            item = self.cursor.next_block()
            if item is None:
                break
            self._block(item)
            self.stopped = self.pusher.flush() or self.stopped
            self.cursor.close_block(steps=self.pusher.pushes)

    def _block(self, item: FeedItem) -> None:
        """Train on one block's batches (the cursor counts the rows consumed)."""
        role, pusher, cursor = self.role, self.pusher, self.cursor
        for xn, yn, wn in batches(item, role.config.batch_size):
            xb, yb, wb = self.model.batch(xn, yn, wn)
            if role.stopped() or self.stopped:
                self.stopped = True
                break
            pusher.position = [role.index, item.epoch, item.block, cursor.consumed + len(yn)]
            stop, loss = pusher.add(xb, yb, self.loss_fn, wb)
            if pusher.pushes == 1 and pusher.count == 0:
                role.started()  # the first gradient is on its way (FitResult.timings)
            if not math.isfinite(loss):
                role.nans.report(loss=loss, step=pusher.pushes, epoch=item.epoch, block=item.block)
                if role.config.on_nan == "stop":
                    self.stopped = True
                    break
            cursor.take(len(yn))
            self.report_stats()
            if stop:
                self.stopped = True
                break
            if pusher.count == 0 and role.pauser.requested():
                # A consistent point: nothing half-accumulated; drain the pushes in flight.
                self.stopped = pusher.drain()
                if not role.pauser.pause(cursor.position(), steps=pusher.pushes) or self.stopped:
                    self.stopped = True
                    break


#: ``prefetch="auto"``: the most pushes in flight it goes to, and how it decides (see _Adapt).
AUTO_MAX_DEPTH = 4


class _Adapt:
    """Chooses how many pushes to keep in flight from what the trainer measures (prefetch="auto").

    A push's round trip (the event loop, the wire, the server's update, the reply) costs about
    the same whatever the batch, while a gradient's cost grows with it. When gradients are cheap
    (a small model, 64 rows) the trainer waits for the servers most of its time with one push
    in flight (34-58% measured); each push more hides one more gradient's worth of round trip,
    at one more update of staleness. So: every ``window`` pushes, one more in flight while the
    trainer spent over 15% of the window waiting, one fewer when under 3%, between 1 and
    ``AUTO_MAX_DEPTH``.
    """

    def __init__(self, window: int = 64) -> None:
        self.window, self.pushes, self.busy, self.waited = window, 0, 0.0, 0.0

    def next_depth(self, depth: int, *, busy_s: float, waited_s: float) -> int:
        self.pushes += 1
        self.busy += busy_s
        self.waited += waited_s
        if self.pushes < self.window:
            return depth
        share = self.waited / max(self.busy + self.waited, 1e-9)
        self.pushes, self.busy, self.waited = 0, 0.0, 0.0
        if share > 0.15 and depth < AUTO_MAX_DEPTH:
            return depth + 1
        if share < 0.03 and depth > 1:
            return depth - 1
        return depth


class _Pusher:
    """Averages the gradients of ``every`` batches and pushes them, keeping ``depth`` in flight.

    With ``depth`` d > 0, up to d pushes travel while the next gradients are computed on the
    parameters received after an earlier update: d updates of extra staleness bought for
    overlapping communication with computation. With 0 the trainer is a plain sequential loop;
    with -1 (``prefetch="auto"``) the depth adapts between 1 and ``AUTO_MAX_DEPTH``.
    """

    def __init__(
        self, ps: PSClient, model: FlatModel, *, every: int, depth: int, buffers: BufferSet
    ) -> None:
        self.adapt = _Adapt() if depth < 0 else None
        depth = 1 if depth < 0 else depth
        self.ps, self.model, self.every, self.depth = ps, model, every, depth
        self.max_depth = AUTO_MAX_DEPTH if self.adapt is not None else depth
        self.computed_s, self.waited_at = time.perf_counter(), 0.0
        # Sent with every push (a new small array each time, so one in flight is never
        # rewritten); the replies do not bring them back: this trainer's running statistics go
        # on from its own batches, which a reply computed before them would overwrite.
        self.bufset = buffers
        # A buffer being filled plus one per push in flight: a push's buffer is never rewritten
        # while it is still being sent.
        self.buffers = [torch.empty(model.n_params) for _ in range(self.max_depth + 1)]
        self.scratch = torch.empty(model.n_params) if every > 1 else None
        self.count = self.samples = self.pushes = 0
        self.pending: collections.deque[Any] = collections.deque()
        self.wait_s = 0.0
        self.version = 0  # the servers' update count in the latest reply (the job's step)
        self.position: list[int] | None = None  # sent with the next push

    def add(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Any,
            w: torch.Tensor | None = None) -> tuple[bool, float]:
        """Add one batch's gradient; push when ``every`` are in.

        Returns (stop, loss): stop is True when the servers say stop. A batch with a non-finite
        loss is left out (nothing accumulated); the caller decides to skip or stop.
        """
        grad = self.buffers[self.pushes % len(self.buffers)]
        target = grad if self.count == 0 else self.scratch
        assert target is not None
        loss = self.model.gradient(x, y, loss_fn, out=target, w=w)
        if not math.isfinite(loss):
            return False, loss
        if self.count > 0:
            grad.add_(target)
        self.count += 1
        self.samples += batch_rows(y)  # several targets: a dict, whose len is its keys
        return (self.flush() if self.count == self.every else False), loss

    def flush(self) -> bool:
        """Push the mean of the gradients gathered so far, if any."""
        if self.count == 0:
            return False
        grad = self.buffers[self.pushes % len(self.buffers)]
        if self.count > 1:
            grad.div_(self.count)
        stop = False
        waited, busy = self.wait_s, time.perf_counter() - self.computed_s
        while len(self.pending) >= max(self.depth, 1):
            stop = self._receive() or stop
        if self.adapt is not None:
            self.depth = self.adapt.next_depth(self.depth, busy_s=busy,
                                               waited_s=self.wait_s - waited)
            self.computed_s = time.perf_counter()
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
        write_params(self.model, exchange)
        return exchange.stop
