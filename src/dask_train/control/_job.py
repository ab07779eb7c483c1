"""The job controller: one coroutine on the client's event loop drives an async-ps job.

It hands blocks to trainers as they free queue slots, turns score events into history and stop
decisions, watches the workers its roles are pinned to, and shuts every role down with a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from distributed import Client, Future, wait
from distributed.comm import CommClosedError

from dask_train.cluster._roles import Roles
from dask_train.control.callbacks import Callback, run_callbacks
from dask_train.control.stop import StopCondition, check_stop
from dask_train.data._blocks import BlockSet
from dask_train.data._feed import feed_block
from dask_train.data._ledger import Ledger
from dask_train.errors import ParameterServerLost, RoleFailed, TrainingTimeout, WorkerLost
from dask_train.models import split_shards
from dask_train.report import history_frame
from dask_train.strategies import async_ps, sync
from dask_train.strategies._ps_client import ShardRef

logger = logging.getLogger(__name__)

_LIVENESS_EVERY_S = 1.0


@dataclass
class JobSpec:
    """Everything the controller needs, validated by the Trainer before it is built."""

    module: torch.nn.Module
    n_params: int
    loss: str
    optimizer: str
    lr: float
    optimizer_options: dict[str, Any]
    batch_size: int
    epochs: int
    shuffle: bool
    seed: int
    prefetch: int
    grad_accumulation: int
    blocks_ahead: int
    score_every: float
    timeout: float
    stop: list[StopCondition]
    callbacks: list[Callback]
    progress: bool
    strategy: str = "async-ps"
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def topic(self) -> str:
        """The event topic of this job's trainers and scorer."""
        return f"dask-train-{self.job_id}"

    @property
    def max_step(self) -> int | None:
        """The tightest step limit among the stop conditions."""
        steps = [c.max_step for c in self.stop if c.max_step is not None]
        return min(steps) if steps else None


class _Controller:
    def __init__(
        self, client: Client, spec: JobSpec, roles: Roles, blocks: BlockSet, validation: Any
    ) -> None:
        self.client = client
        self.spec = spec
        self.roles = roles
        self.blocks = blocks
        self.validation = validation
        trainers = roles["worker"]
        self.ledger = Ledger(
            blocks.blocks, trainers, epochs=spec.epochs, shuffle=spec.shuffle, seed=spec.seed
        )
        if spec.strategy == "sync":
            # No servers: rank 0 registers its own optimizer as the job's only shard.
            self.shards = [ShardRef(0, 0, spec.n_params, trainers[0])]
        else:
            shards = split_shards(spec.n_params, len(roles["ps"]))
            self.shards = [
                ShardRef(s.index, s.start, s.stop, roles["ps"][s.index]) for s in shards
            ]
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.records: list[dict[str, Any]] = []
        self.feeds: list[Future] = []
        self.ended = [False] * len(trainers)
        self.sequence = [0] * len(trainers)
        self.trainer_futures: list[Future] = []
        self.scorer_future: Future | None = None
        self.t0 = time.time()
        self.stopped_by = ""
        self.epochs_seen = 0
        self.finished_at = 0.0
        self.stop_step: int | None = None  # the step of the score that stopped the job
        self.progress: Any = None

    # -- starting -------------------------------------------------------------------------------
    def _pinned(self, fn: Any, *args: Any, address: str, key: str, **kwargs: Any) -> Future:
        # Pinned with no fallback: a role's state lives on that worker. pure=False: each call has
        # side effects and must run exactly once. retries stay 0: a lost role is the controller's
        # decision, not a silent re-run elsewhere.
        return self.client.submit(
            fn, *args, workers=[address], allow_other_workers=False, pure=False,
            key=f"{key}-{self.spec.job_id}", **kwargs,
        )

    async def start(self) -> None:
        spec = self.spec
        module_f = await self.client.scatter(spec.module, hash=False, asynchronous=True)
        if spec.strategy != "sync":
            starts = [
                self._pinned(
                    async_ps.start_shard_task, module_f, address=ref.address,
                    key=f"dt-ps-{ref.index}", job=spec.job_id, shard=ref,
                    optimizer=spec.optimizer, lr=spec.lr, options=spec.optimizer_options,
                    max_step=spec.max_step,
                )
                for ref in self.shards
            ]
            await self._wait(starts, what="starting the parameter servers")
        config = {
            "loss": spec.loss, "batch_size": spec.batch_size, "prefetch": spec.prefetch,
            "grad_accumulation": spec.grad_accumulation,
            "timeout": spec.timeout, "topic": spec.topic, "score_every": spec.score_every,
            "optimizer": spec.optimizer, "lr": spec.lr,
            "optimizer_options": spec.optimizer_options, "max_step": spec.max_step,
        }
        run_trainer = sync.run_rank if spec.strategy == "sync" else async_ps.run_trainer
        self.client.subscribe_topic(spec.topic, lambda event: self.events.put_nowait(event[1]))
        if self.validation is not None and self.roles["scorer"]:
            address = self.roles["scorer"][0]
            [val_f] = await self.client.scatter(
                [self.validation], workers=[address], hash=False, asynchronous=True
            )
            self.scorer_future = self._pinned(
                async_ps.run_scorer, module_f, val_f, address=address, key="dt-scorer",
                job=spec.job_id, shards=self.shards, config=config,
            )
        self.t0 = time.time()
        for i, address in enumerate(self.roles["worker"]):
            self.trainer_futures.append(
                self._pinned(
                    run_trainer, module_f, address=address, key=f"dt-worker-{i}",
                    job=spec.job_id, index=i, shards=self.shards, config=config,
                )
            )
        # Round-robin over the trainers, so the first cannot take every block of a small job
        # before the others get one.
        for _ in range(spec.blocks_ahead):
            for i in range(len(self.roles["worker"])):
                self._grant(i)

    async def _wait(self, futures: list[Future], *, what: str) -> None:
        try:
            await wait(futures, timeout=self.spec.timeout)
        except TimeoutError:
            raise TrainingTimeout(
                f"{what} took longer than timeout={self.spec.timeout:g} s; check that the workers "
                "are alive (dashboard) or raise timeout="
            ) from None
        for fut in futures:
            if fut.status == "error":
                await self._raise_role_error(fut, what)

    async def _raise_role_error(self, fut: Future, role: str) -> None:
        exc = await fut.exception()
        tb = await fut.traceback()
        raise RoleFailed(f"{role} failed: {type(exc).__name__}: {exc}") from exc.with_traceback(tb)

    def _grant(self, trainer: int) -> None:
        """Hand ``trainer`` its next block, or the end marker once every epoch is handed out."""
        if self.ended[trainer]:
            return
        a = self.ledger.next_for(trainer)
        address = self.roles["worker"][trainer]
        common = {"job": self.spec.job_id, "trainer": trainer, "seed": self.spec.seed,
                  "shuffle": self.spec.shuffle, "seq": self.sequence[trainer]}
        self.sequence[trainer] += 1
        if a is None:
            self.ended[trainer] = True
            fut = self._pinned(feed_block, None, address=address, key=f"dt-end-{trainer}",
                               epoch=-1, block=-1, **common)
        else:
            fut = self._pinned(
                feed_block, self.blocks.futures[a.block], address=address,
                key=f"dt-feed-{a.epoch}-{a.block}", epoch=a.epoch, block=a.block, **common,
            )
        self.feeds.append(fut)

    # -- running ----------------------------------------------------------------------------------
    async def run(self) -> None:
        next_liveness = 0.0
        while not self.stopped_by:
            try:
                event = await asyncio.wait_for(self.events.get(), timeout=0.2)
            except asyncio.TimeoutError:
                event = None
            if event is not None:
                self._on_event(event)
            now = time.time()
            if not self.stopped_by:
                self._tick(now)
            if now >= next_liveness:
                next_liveness = now + _LIVENESS_EVERY_S
                await self._check_roles()

    def _on_event(self, event: dict[str, Any]) -> None:
        if event.get("kind") == "block":
            self.ledger.consumed(
                epoch=event["epoch"], block=event["block"], trainer=event["trainer"],
                rows=event["rows"], done=event["done"],
            )
            self._grant(event["trainer"])
            self._epoch_progress()
        elif event.get("kind") == "score":
            self._on_score(event)

    def _on_score(self, event: dict[str, Any]) -> None:
        record = self._record(event)
        self.records.append(record)
        if self.progress is not None:
            self.progress.update(record)
        if run_callbacks(self.spec.callbacks, "on_score", record):
            self._stop("callback")
        fired = check_stop(self.spec.stop, record, elapsed_s=record["time_s"], step=record["step"])
        if fired is not None:
            self._stop(fired.describe())
        if self.stopped_by and self.stop_step is None:
            self.stop_step = record["step"]

    def _record(self, event: dict[str, Any]) -> dict[str, Any]:
        now = time.time() - self.t0
        prev = self.records[-1] if self.records else {"time_s": 0.0, "samples": 0}
        dt = now - prev["time_s"]
        rate = (event["samples"] - prev["samples"]) / dt if dt > 0 else math.nan
        return {
            "time_s": now, "step": int(event["step"]),
            "epoch": event["samples"] / max(1, self.blocks.rows),
            "samples": int(event["samples"]), "accuracy": event.get("accuracy", math.nan),
            "loss": event.get("loss", math.nan), "samples_per_s": rate,
        }

    def _epoch_progress(self) -> None:
        done = self.ledger.epochs_completed
        while self.epochs_seen < done:
            self.epochs_seen += 1
            last = self.records[-1] if self.records else None
            if run_callbacks(self.spec.callbacks, "on_epoch_end", self.epochs_seen, last):
                self._stop("callback")

    def _tick(self, now: float) -> None:
        step = self.records[-1]["step"] if self.records else 0
        fired = check_stop(self.spec.stop, None, elapsed_s=now - self.t0, step=step)
        if fired is not None:
            self._stop(fired.describe())
        elif self.trainer_futures and all(f.status == "finished" for f in self.trainer_futures):
            # A trainer's last block event and its task's completion travel separately: give
            # the events a moment to arrive before deciding why the job ended.
            self.finished_at = self.finished_at or now
            if self.ledger.all_reported() or now - self.finished_at > 2.0:
                self._stop(self._natural_end())

    def _natural_end(self) -> str:
        if all(self.ended) and self.ledger.epochs_completed >= self.spec.epochs:
            return f"epochs={self.spec.epochs}"
        limits = [c for c in self.spec.stop if c.max_step is not None]
        return min(limits, key=lambda c: c.max_step or 0).describe() if limits else "trainers ended"

    def _stop(self, reason: str) -> None:
        if not self.stopped_by:
            self.stopped_by = reason
            logger.info("job %s stopping: %s", self.spec.job_id, reason)

    async def _check_roles(self) -> None:
        failed = [
            (fut, f"trainer worker-{i} on {self.roles['worker'][i]}")
            for i, fut in enumerate(self.trainer_futures) if fut.status == "error"
        ]
        if self.scorer_future is not None and self.scorer_future.status == "error":
            failed.append((self.scorer_future, "the scorer"))
        failed += [(f, f"feeding block task {f.key}") for f in self.feeds if f.status == "error"]
        self.feeds = [f for f in self.feeds if f.status != "finished"]
        if failed:
            # A role whose connection broke usually lost it because a worker died: wait briefly
            # for the scheduler to notice, and report the lost worker, the root cause.
            exc = await failed[0][0].exception()
            tries = 20 if isinstance(exc, (OSError, CommClosedError)) else 1
            for _ in range(tries):
                lost = await self._lost_role()
                if lost is not None:
                    raise lost
                await asyncio.sleep(0.1)
            await self._raise_role_error(*failed[0])
        lost = await self._lost_role()
        if lost is not None:
            raise lost

    async def _lost_role(self) -> WorkerLost | None:
        alive = set((await self.client.scheduler.identity()).get("workers", {}))
        # Servers first: losing one loses parameters, the more specific error to report.
        for kind in ("ps", "worker", "scorer"):
            for i, address in enumerate(self.roles[kind]):
                if address not in alive:
                    return _lost(kind, i, address)
        return None

    # -- stopping ---------------------------------------------------------------------------------
    async def finish(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """Stop every role (each wait bounded by the timeout); return the scorer's final answer."""
        spec, client = self.spec, self.client
        await client.run(async_ps.signal_stop, spec.job_id, workers=self.roles.addresses,
                         asynchronous=True)
        await self._wait(self.trainer_futures, what="stopping the trainers")
        trainers = [await f for f in self.trainer_futures]
        final = None
        if self.scorer_future is not None:
            await client.run(async_ps.signal_stop, spec.job_id, scorer=True,
                             keep_step=self.stop_step, workers=self.roles["scorer"],
                             asynchronous=True)
            await self._wait([self.scorer_future], what="the final score")
            final = await self.scorer_future
        return final, trainers

    async def pull_parameters(self) -> tuple[np.ndarray, int, int]:
        """The final flat parameters, with the servers' step and sample counts."""
        futures = [
            self._pinned(async_ps.pull_shard_task, address=ref.address, key=f"dt-pull-{ref.index}",
                         job=self.spec.job_id, index=ref.index)
            for ref in self.shards
        ]
        await self._wait(futures, what="pulling the final parameters")
        parts = await self.client.gather(futures, asynchronous=True)
        params = np.concatenate([p[0] for p in parts])
        return params, min(p[1] for p in parts), min(p[2] for p in parts)

    async def cleanup(self) -> None:
        self.client.unsubscribe_topic(self.spec.topic)
        # unsubscribe_topic only tells the scheduler; the client keeps the handler, and with it
        # this controller, its blocks and role futures, for as long as the client lives.
        getattr(self.client, "_event_handlers", {}).pop(self.spec.topic, None)
        self.trainer_futures, self.feeds, self.scorer_future = [], [], None
        alive = set((await self.client.scheduler.identity()).get("workers", {}))
        workers = [a for a in self.roles.addresses if a in alive]
        if workers:
            await self.client.run(async_ps.drop_job, self.spec.job_id, workers=workers,
                                  asynchronous=True, on_error="ignore")


def _lost(kind: str, index: int, address: str) -> WorkerLost:
    name = {"worker": "trainer", "ps": "parameter server", "scorer": "scorer"}[kind]
    cls = ParameterServerLost if kind == "ps" else WorkerLost
    return cls(
        f"the Dask worker {address} holding {name} {kind}-{index} left the cluster during "
        "training; the job was stopped. Check that worker's logs (memory limit, OOM kill) and "
        "run fit again.",
        worker=address, role=f"{kind}-{index}",
    )


async def run_job(
    client: Client, spec: JobSpec, roles: Roles, blocks: BlockSet, validation: Any, progress: Any
) -> tuple[_Controller, dict[str, Any] | None, list[dict[str, Any]], tuple[np.ndarray, int, int]]:
    """Run one async-ps job to its end; always stops its roles, also on error."""
    ctl = _Controller(client, spec, roles, blocks, validation)
    ctl.progress = progress
    try:
        await ctl.start()
        await ctl.run()
        final, trainers = await ctl.finish()
        params = await ctl.pull_parameters()
    finally:
        try:
            await asyncio.wait_for(ctl.cleanup(), timeout=spec.timeout)
        except Exception:  # cleanup must not hide the job's own error
            logger.exception("cleaning up job %s failed", spec.job_id)
    if final is not None and final["params"] is None:
        ctl._on_score(final["record"])  # the final parameters' score closes the history
    return ctl, final, trainers, params


def history(ctl: _Controller) -> pd.DataFrame:
    """The job's score records as the history DataFrame."""
    return history_frame(ctl.records)
