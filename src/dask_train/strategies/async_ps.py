"""Asynchronous parameter-server training: shard servers, trainers and the scorer, as worker code.

Each function named ``run_*`` or ``*_task`` is submitted by the controller as a Dask task pinned to
its role's worker (``workers=[address]``, ``allow_other_workers=False``, ``pure=False`` because it
has side effects and must run once per call). Long-running roles ``secede()`` from the worker's
thread pool at once so that roles sharing a process, and the feed tasks, never wait for a thread.
"""

from __future__ import annotations

import collections
import copy
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from distributed import get_worker, secede

from dask_train.cluster._plugin import worker_state
from dask_train.data._feed import FeedReader, batches
from dask_train.models import LOSSES, FlatModel, build_optimizer, evaluate, flatten_parameters
from dask_train.strategies._ps_client import PSClient, ShardRef, write_params
from dask_train.strategies._state import NanReporter, Pauser, read_slice, rng_state, seed_trainer

# Blocks per trainer whose applied rows a server remembers: more than a trainer can have between
# its last delivered event and its death (one being read plus those queued ahead).
_POSITIONS_KEPT = 8


class ShardServer:
    """One parameter-server shard: a flat slice of the parameters and its optimizer state.

    Gradients are applied as they arrive (Hogwild-free: a lock serializes updates of one shard, and
    the parameters returned are a copy taken under it, so a reply is never torn).

    Parameters
    ----------
    params : numpy.ndarray or torch.Tensor
        Initial values of the slice: an array is copied, a float32 tensor is updated in place.
    optimizer : str
        A name from :data:`dask_train.models.OPTIMIZERS`.
    lr : float
    options : mapping
        Extra optimizer keyword arguments (momentum, betas, weight_decay, ...).
    max_step : int or None
        Updates beyond this many are refused and answered with ``stop=True``, so a step limit is
        exact however many trainers push at once.
    grad : torch.Tensor or None
        The optimizer's gradient buffer; by default a new one. The sync strategy passes the buffer
        its all-reduce fills, so a step needs no copy of the gradient (see :meth:`step`).
    """

    def __init__(
        self,
        params: np.ndarray | torch.Tensor,
        *,
        optimizer: str,
        lr: float,
        options: Mapping[str, Any],
        max_step: int | None = None,
        grad: torch.Tensor | None = None,
    ) -> None:
        values = params if isinstance(params, torch.Tensor) else torch.from_numpy(
            np.array(params, dtype=np.float32)
        )
        # A tensor is used in place (the sync strategy updates a rank's own flat parameters);
        # an array is copied (a server owns its slice).
        self.param = torch.nn.Parameter(values)
        self.grad = torch.zeros_like(self.param) if grad is None else grad
        self.param.grad = self.grad
        self.optimizer = build_optimizer(optimizer, [self.param], lr=lr, options=options)
        self.max_step = max_step
        self.version = 0
        self.samples = 0
        # trainer -> {(epoch, block): rows of that block applied so far}, its last few blocks:
        # after a trainer's loss the controller re-feeds exactly the rows the parameters have
        # not seen, even when the trainer's last "block consumed" events died with it.
        self.positions: dict[int, dict[tuple[int, int], int]] = {}
        self._lock = threading.Lock()

    def apply(
        self, grad: np.ndarray, samples: int, position: Sequence[int] | None = None
    ) -> tuple[np.ndarray, int, bool]:
        """Apply one gradient; return (parameters copy, version, stop).

        ``position`` is ``(trainer, epoch, block, rows)``: the pushing trainer's place in its data
        once this gradient is applied.
        """
        with self._lock:
            if self.max_step is not None and self.version >= self.max_step:
                return self.param.detach().numpy().copy(), self.version, True
            # Copy into a grad buffer we own: received frames may be read-only.
            self.grad.numpy()[:] = grad
            self._step(samples)
            if position is not None:
                seen = self.positions.setdefault(int(position[0]), {})
                seen[(int(position[1]), int(position[2]))] = int(position[3])
                if len(seen) > _POSITIONS_KEPT:
                    del seen[next(iter(seen))]  # the oldest: dicts keep insertion order
            stop = self.max_step is not None and self.version >= self.max_step
            return self.param.detach().numpy().copy(), self.version, stop

    def step(self, samples: int) -> bool:
        """Apply the gradient already in :attr:`grad`; return whether the step limit is reached.

        No copy in or out, for the sync strategy, whose rank owns the parameters it updates.
        """
        with self._lock:
            if self.max_step is not None and self.version >= self.max_step:
                return True
            self._step(samples)
            return self.max_step is not None and self.version >= self.max_step

    def _step(self, samples: int) -> None:
        self.optimizer.step()
        self.version += 1
        self.samples += int(samples)

    def pull(self) -> tuple[np.ndarray, int, int]:
        """Return (parameters copy, version, samples)."""
        with self._lock:
            return self.param.detach().numpy().copy(), self.version, self.samples

    def save(self, path: str, *, metadata: Mapping[str, str]) -> dict[str, Any]:
        """Write the slice and its optimizer state to ``path`` (atomic); return what was saved."""
        from dask_train.checkpoint import save_shard

        with self._lock:
            saved = {"path": path, "version": self.version, "samples": self.samples,
                     "finite": True}
            if not bool(torch.isfinite(self.param).all()):
                # Never overwrite good checkpoints with bad parameters: the last good one stays.
                return {**saved, "path": None, "finite": False}
            meta = {"version": str(self.version), "samples": str(self.samples), **metadata}
            save_shard(path, param=self.param.detach(), optimizer=self.optimizer, metadata=meta)
            return saved

    def restore(self, state: Any, *, version: int, samples: int) -> None:
        """Load parameters and optimizer state (a ``checkpoint.ShardState``) into this shard."""
        from dask_train.checkpoint import restore_optimizer

        with self._lock:
            self.param.data.copy_(state.param)
            restore_optimizer(self.optimizer, state)
            self.version, self.samples = int(version), int(samples)


def start_shard_task(
    module: torch.nn.Module,
    *,
    job: str,
    shard: ShardRef,
    optimizer: str,
    lr: float,
    options: Mapping[str, Any],
    max_step: int | None,
    restore: Mapping[str, Any] | None = None,
) -> str:
    """Dask task: create one shard on this worker, from the module or from a checkpoint.

    ``restore`` is ``{"files": manifest shard records, "step": int, "samples": int}``: the shard
    loads its slice (parameters and optimizer state) from the checkpoint's files itself.
    """
    flat = flatten_parameters(module).numpy()
    server = ShardServer(
        flat[shard.start : shard.stop],
        optimizer=optimizer,
        lr=lr,
        options=options,
        max_step=max_step,
    )
    if restore is not None:
        state = read_slice(restore["files"], shard.start, shard.stop)
        server.restore(state, version=restore["step"], samples=restore["samples"])
    worker = get_worker()
    worker_state(worker).job(job).shards[shard.index] = server
    return worker.address


def pull_shard_task(*, job: str, index: int) -> tuple[np.ndarray, int, int]:
    """Dask task: (parameters, version, samples) of one shard on this worker."""
    state = worker_state().jobs.get(job)
    if state is None or index not in state.shards:
        raise KeyError(f"shard {index} of job {job!r} is not on this worker")
    return state.shards[index].pull()


def signal_stop(
    job: str, *, scorer: bool = False, keep_step: int | None = None, dask_worker: Any = None
) -> None:
    """Run on workers (``client.run``): ask the job's trainers, or its scorer, to stop.

    ``keep_step`` tells the scorer which scored snapshot to hand back as the result's model.
    """
    state = worker_state(dask_worker).job(job)
    if scorer:
        state.scorer_keep = keep_step
        state.scorer_stop.set()
    else:
        state.stop.set()


def drop_job(job: str, dask_worker: Any = None) -> None:
    """Run on workers (``client.run``): forget a finished job and free its memory."""
    worker_state(dask_worker).drop(job)


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
    state = worker_state(worker).job(job)
    secede()
    role = f"worker-{index} on {worker.address}"
    seed_trainer(seed=config["seed"], index=index, saved=config.get("rng"))
    ps = PSClient(worker, job, state, shards, timeout=config["timeout"])
    model = FlatModel(copy.deepcopy(module))
    model.module.train()
    write_params(model.flat, ps.pull())
    pusher = _Pusher(ps, model, every=config["grad_accumulation"], depth=config["prefetch"])
    loss_fn = LOSSES[config["loss"]]
    pauser = Pauser(worker, state, topic=config["topic"], trainer=index, timeout=config["timeout"])
    nans = NanReporter(worker, topic=config["topic"], trainer=index)
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
        for xb, yb in batches(item, config["batch_size"]):
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

    def __init__(self, ps: PSClient, model: FlatModel, *, every: int, depth: int) -> None:
        self.ps, self.model, self.every, self.depth = ps, model, every, depth
        # A buffer being filled plus one per push in flight: a push's buffer is never rewritten
        # while it is still being sent.
        self.buffers = [torch.empty(model.n_params) for _ in range(depth + 1)]
        self.scratch = torch.empty(model.n_params) if every > 1 else None
        self.count = self.samples = self.pushes = 0
        self.pending: collections.deque[Any] = collections.deque()
        self.wait_s = 0.0
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
        self.pending.append(self.ps.push(grad, self.samples, self.position))
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
        write_params(self.model.flat, exchange)
        return exchange.stop


def run_scorer(
    module: torch.nn.Module,
    validation: tuple[np.ndarray, np.ndarray],
    *,
    job: str,
    shards: Sequence[ShardRef],
    config: Mapping[str, Any],
) -> dict[str, Any]:
    """Dask task: every ``score_every`` seconds evaluate the latest parameters and publish the score.

    Scores go out with ``worker.log_event`` (5,000 events in 0.12 s here), never through a Queue.
    The last few scored parameter snapshots are kept: when a score stopped the job, the model that
    earned it is returned (``{"record", "params"}``), not the one a few asynchronous steps later.
    Otherwise it scores the final parameters once more and returns that record alone.
    """
    worker = get_worker()
    state = worker_state(worker).job(job)
    secede()
    ps = PSClient(worker, job, state, shards, timeout=config["timeout"])
    model = FlatModel(copy.deepcopy(module))
    x_val, y_val = validation
    snapshots: dict[int, tuple[dict[str, Any], np.ndarray]] = {}
    while not state.scorer_stop.wait(config["score_every"]):
        try:
            record = _score(ps, model, x_val, y_val, loss=config["loss"])
        except KeyError:
            # The parameters are not published yet (a sync job's rank 0 is still starting);
            # a worker that vanished instead is the controller's to report.
            continue
        if record["step"] not in snapshots:
            snapshots[record["step"]] = (record, model.flat.numpy().copy())
            for old in sorted(snapshots)[:-_SNAPSHOTS]:
                del snapshots[old]
            worker.log_event(config["topic"], {"kind": "score", **record})
    if state.scorer_keep in snapshots:
        record, params = snapshots[state.scorer_keep]
        return {"record": record, "params": params}
    return {"record": _score(ps, model, x_val, y_val, loss=config["loss"]), "params": None}


# Scores reach the controller within milliseconds, so the one that stops a job is among the last.
_SNAPSHOTS = 4


def _score(
    ps: PSClient, model: FlatModel, x: np.ndarray, y: np.ndarray, *, loss: str
) -> dict[str, Any]:
    exchange = ps.pull()
    write_params(model.flat, exchange)
    scores = evaluate(model.module, x, y, loss=loss)
    bad = {k: v for k, v in scores.items() if not math.isfinite(v)}
    return {
        "step": exchange.version,
        "samples": exchange.samples,
        "wall": time.time(),
        "nonfinite": sorted(bad),
        **scores,
    }
