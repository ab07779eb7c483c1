"""The job controller: one coroutine on the client's event loop drives one generation of a job.

It hands blocks to trainers as they free queue slots, turns score events into history and stop
decisions, takes checkpoints, watches the workers its roles are pinned to (lost roles go to the
failure policy, see ``_recovery.py``), and shuts every role down with a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import numpy as np
import pandas as pd
from distributed import Client, Future, wait

from dask_train.controller._checkpointing import Checkpointer, Restore, patch_positions, run_on_live
from dask_train.controller._spec import JobLog, JobSpec
from dask_train.data._blocks import BlockSet
from dask_train.engines import _ps_server, _scorer, async_ps, sync_torch
from dask_train.engines import _worker as _state
from dask_train.engines._ps_client import ShardRef
from dask_train.errors import RoleFailed, TrainingTimeout
from dask_train.models._torch import split_shards
from dask_train.policy._ledger import Ledger
from dask_train.policy._placement import Roles
from dask_train.policy.callbacks import run_callbacks
from dask_train.policy.stop import check_stop
from dask_train.report import history_frame
from dask_train.runtime._compat import drop_topic_handler
from dask_train.runtime._feed import feed_block

logger = logging.getLogger(__name__)

_LIVENESS_EVERY_S = 1.0


class _Controller:
    def __init__(
        self, client: Client, spec: JobSpec, roles: Roles, blocks: BlockSet, validation: Any,
        *, log: JobLog, generation: int = 0, restore: Restore | None = None,
    ) -> None:
        self.client = client
        self.spec = spec
        self.roles = roles
        self.blocks = blocks
        self.validation = validation
        self.log = log
        self.generation = generation
        self.restore = restore
        # One key per generation: its worker state, tasks and events never mix with an older
        # generation's stragglers.
        self.job = f"{spec.job_id}-g{generation}"
        trainers = roles["worker"]
        if restore is not None:
            self.ledger = Ledger.from_state(
                blocks.blocks, trainers, epochs=spec.epochs, shuffle=spec.shuffle, seed=spec.seed,
                state=restore.manifest["ledger"],
            )
        else:
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
        self.feeds: list[tuple[int, Future]] = []
        self.direct_feeds: set[asyncio.Task[None]] = set()
        self.ended = [False] * len(trainers)
        self.idle = [False] * len(trainers)  # async: out of blocks, waiting for the job's end
        self.retired: set[int] = set()
        self.trainer_steps: dict[int, int] = {}  # pushes (async) or steps (sync) per trainer
        self.exited: set[int] = set()  # trainers whose last event has arrived
        self.sequence = [0] * len(trainers)
        self.trainer_futures: list[Future] = []
        self.scorer_future: Future | None = None
        self.scorer_restarts = 0
        self.module_f: Future | None = None
        self.config: dict[str, Any] = {}
        self.t0 = time.time()
        self.stopped_by = ""
        self.epochs_seen = self.ledger.epochs_completed
        self.finished_at = 0.0
        self.last_heartbeat = 0.0
        self.stop_step: int | None = None  # the step of the score that stopped the job
        self.nan_stop = False
        self.progress: Any = None
        self.checkpointer: Checkpointer | None = None
        if spec.checkpoint is not None:
            self.checkpointer = Checkpointer(
                client, spec.checkpoint, job=self.job, generation=generation, timeout=spec.timeout,
                start_step=restore.step if restore is not None else 0,
            )

    @property
    def topic(self) -> str:
        """The event topic of this generation's trainers and scorer."""
        return f"dask-train-{self.job}"

    @property
    def records(self) -> list[dict[str, Any]]:
        """Score records of the whole job (every generation)."""
        return self.log.records

    # -- starting -------------------------------------------------------------------------------
    def _pinned(self, fn: Any, *args: Any, address: str, key: str, **kwargs: Any) -> Future:
        # Pinned with no fallback: a role's state lives on that worker. pure=False: each call has
        # side effects and must run exactly once. retries stay 0: a lost role is the controller's
        # decision, not a silent re-run elsewhere.
        return self.client.submit(
            fn, *args, workers=[address], allow_other_workers=False, pure=False,
            key=f"{key}-{self.job}", **kwargs,
        )

    async def start(self) -> None:
        spec = self.spec
        self.module_f = await self.client.scatter(spec.module, hash=False, asynchronous=True)
        restore = None
        if self.restore is not None:
            assert spec.checkpoint is not None
            assert self.checkpointer is not None
            restore = self.restore.server_state(self.checkpointer.store)
        if spec.strategy != "sync":
            starts = [
                self._pinned(
                    _ps_server.start_shard_task, self.module_f, address=ref.address,
                    key=f"dt-ps-{ref.index}", job=self.job, shard=ref,
                    optimizer=spec.optimizer, lr=spec.lr, options=spec.optimizer_options,
                    max_step=spec.max_step, restore=restore,
                )
                for ref in self.shards
            ]
            await self._wait(starts, what="starting the parameter servers")
        self.config = {
            "loss": spec.loss, "batch_size": spec.batch_size, "prefetch": spec.prefetch,
            "grad_accumulation": spec.grad_accumulation,
            "timeout": spec.timeout, "topic": self.topic, "score_every": spec.score_every,
            "optimizer": spec.optimizer, "lr": spec.lr,
            "optimizer_options": spec.optimizer_options, "max_step": spec.max_step,
            "seed": spec.seed, "on_nan": spec.on_nan,
            "rng": (self.restore.manifest.get("rng") or {}) if self.restore is not None else {},
            "restore": restore if spec.strategy == "sync" else None,
        }
        run_trainer = sync_torch.run_rank if spec.strategy == "sync" else async_ps.run_trainer
        self.client.subscribe_topic(self.topic, lambda event: self.events.put_nowait(event[1]))
        if self.validation is not None and self.roles["scorer"]:
            await self.start_scorer(self.roles["scorer"][0])
        self.t0 = time.time()
        for i, address in enumerate(self.roles["worker"]):
            self.trainer_futures.append(
                self._pinned(
                    run_trainer, self.module_f, address=address, key=f"dt-worker-{i}",
                    job=self.job, index=i, shards=self.shards, config=self.config,
                )
            )
        # Round-robin over the trainers, so the first cannot take every block of a small job
        # before the others get one.
        for _ in range(spec.blocks_ahead):
            for i in range(len(self.roles["worker"])):
                self._grant(i)

    async def start_scorer(self, address: str) -> None:
        """Start (or restart, on another worker) the scorer on ``address``."""
        [val_f] = await self.client.scatter(
            [self.validation], workers=[address], hash=False, asynchronous=True
        )
        suffix = f"-r{self.scorer_restarts}" if self.scorer_restarts else ""
        self.scorer_future = self._pinned(
            _scorer.run_scorer, self.module_f, val_f, address=address, key=f"dt-scorer{suffix}",
            job=self.job, shards=self.shards, config=self.config,
        )
        self.roles = Roles({**self.roles.placement, "scorer": [address]})

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
                await self.raise_role_error(fut, what)

    async def raise_role_error(self, fut: Future, role: str) -> None:
        exc = await fut.exception()
        tb = await fut.traceback()
        raise RoleFailed(f"{role} failed: {type(exc).__name__}: {exc}") from exc.with_traceback(tb)

    def _grant(self, trainer: int) -> None:
        """Hand ``trainer`` its next block, or the end marker once every epoch is handed out."""
        if self.ended[trainer] or trainer in self.retired or self.stopped_by:
            return
        a = self.ledger.next_for(trainer)
        if a is None and self.spec.strategy != "sync":
            # Async: no end marker yet. Until every block is consumed, a lost trainer's blocks
            # may still come back to this one (see _end_idle).
            self.idle[trainer] = True
            self._end_idle()
            return
        self.idle[trainer] = False
        address = self.roles["worker"][trainer]
        common = {"job": self.job, "trainer": trainer, "seed": self.spec.seed,
                  "shuffle": self.spec.shuffle, "seq": self.sequence[trainer]}
        self.sequence[trainer] += 1
        if a is None:
            self.ended[trainer] = True
            fut = self._pinned(feed_block, None, address=address, key=f"dt-end-{trainer}",
                               epoch=-1, block=-1, **common)
        elif a.local and self._feed_direct(trainer, address, a, common):
            return
        else:
            fut = self._feed_task(trainer, address, a, common)
        self.feeds.append((trainer, fut))

    def _feed_task(self, trainer: int, address: str, a: Any, common: dict[str, Any]) -> Future:
        return self._pinned(
            feed_block, self.blocks.futures[a.block], address=address,
            key=f"dt-feed-{a.epoch}-{a.block}-{trainer}", epoch=a.epoch, block=a.block,
            skip=a.skip, **common,
        )

    def _feed_direct(self, trainer: int, address: str, a: Any, common: dict[str, Any]) -> bool:
        """Queue a local block by one RPC to its worker; False when there is no loop to run it."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False

        async def send() -> None:
            try:
                rows = await self.client.rpc(address).dask_train_feed(
                    key=self.blocks.futures[a.block].key, epoch=a.epoch, block=a.block,
                    skip=a.skip, **common)
            except Exception:  # a lost worker or a broken connection: the task path decides
                rows = -1
            if rows < 0 and not self.stopped_by:
                # The block left that worker (or never was there): a task brings it.
                self.feeds.append((trainer, self._feed_task(trainer, address, a, common)))

        task = loop.create_task(send())
        self.direct_feeds.add(task)  # a reference, or the task could be collected mid-flight
        task.add_done_callback(self.direct_feeds.discard)
        return True

    def add_trainer(self, address: str) -> int:
        """Start a trainer on a worker that joined (or came back) during training."""
        index = self.ledger.add_trainer(address)
        self.roles = Roles({**self.roles.placement, "worker": self.roles["worker"] + [address]})
        assert index == len(self.roles["worker"]) - 1
        self.ended.append(False)
        self.idle.append(False)
        self.sequence.append(0)
        run_trainer = sync_torch.run_rank if self.spec.strategy == "sync" else async_ps.run_trainer
        self.trainer_futures.append(self._pinned(
            run_trainer, self.module_f, address=address, key=f"dt-worker-{index}",
            job=self.job, index=index, shards=self.shards, config=self.config,
        ))
        for _ in range(self.spec.blocks_ahead):
            self._grant(index)
        logger.info("job %s: trainer %d joined on %s", self.job, index, address)
        return index

    def live_trainers(self) -> list[int]:
        """Trainers not lost (retired) and not known to have ended."""
        return [i for i in range(len(self.roles["worker"])) if i not in self.retired]

    def _end_idle(self) -> None:
        """Send end markers to idle trainers once every block handed out has been consumed."""
        live = self.live_trainers()
        if not all(self.idle[i] for i in live) or not self.ledger.all_reported():
            return
        for i in live:
            self.idle[i] = False
            address = self.roles["worker"][i]
            fut = self._pinned(feed_block, None, address=address, key=f"dt-end-{i}",
                               job=self.job, trainer=i, seed=self.spec.seed,
                               shuffle=self.spec.shuffle, seq=self.sequence[i], epoch=-1, block=-1)
            self.sequence[i] += 1
            self.ended[i] = True
            self.feeds.append((i, fut))

    def regrant_idle(self) -> None:
        """Give idle trainers work that came back (a lost trainer's blocks)."""
        for i in self.live_trainers():
            if self.idle[i]:
                self.idle[i] = False
                self._grant(i)

    # -- running ----------------------------------------------------------------------------------
    async def run(self, check_roles: Any) -> None:
        """Drive the job until it stops; ``check_roles(ctl)`` handles lost or failed roles."""
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
                await self._checkpoint_step(now)
            if now >= next_liveness:
                next_liveness = now + _LIVENESS_EVERY_S
                await check_roles(self)

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "block":
            if event["trainer"] in self.retired:
                return
            self._on_steps(event["trainer"], event["steps"])
            self.ledger.consumed(
                epoch=event["epoch"], block=event["block"], trainer=event["trainer"],
                rows=event["rows"], done=event["done"],
            )
            self._grant(event["trainer"])
            self._end_idle()
            self._epoch_progress()
        elif kind == "score":
            self.on_score(event)
        elif kind == "paused" and self.checkpointer is not None:
            self._on_steps(event["trainer"], event["steps"])
            self.checkpointer.on_paused(event)
        elif kind == "nan":
            self._on_nan(event)
        elif kind == "exit":
            self.exited.add(int(event["trainer"]))

    def _on_nan(self, event: dict[str, Any]) -> None:
        record = {"role": f"worker-{event['trainer']}", "step": int(event["step"]),
                  "loss": event["loss"], "epoch": event["epoch"], "block": event["block"]}
        self.log.nonfinite.append(record)
        logger.warning("non-finite loss %s at step %d on %s", record["loss"], record["step"],
                       record["role"])
        if self.spec.on_nan == "stop":
            self.nan_stop = True
            self._stop(f"non-finite loss ({record['loss']}) at step {record['step']} on "
                       f"{record['role']}")

    def on_score(self, event: dict[str, Any]) -> None:
        record = self._record(event)
        bad = event.get("nonfinite") or []
        if bad:
            self.log.nonfinite.append({"role": "scorer", "step": record["step"], "metrics": bad})
            if self.spec.on_nan == "stop":
                self.nan_stop = True
                self._stop(f"non-finite score ({', '.join(bad)}) at step {record['step']}")
                return
            if self.spec.on_nan == "skip":
                return  # not recorded: stop conditions never see a NaN score
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

    def elapsed(self, now: float | None = None) -> float:
        """Seconds of training in this job, resumed time included."""
        return (now or time.time()) - self.log.started + self.log.elapsed_offset

    def _record(self, event: dict[str, Any]) -> dict[str, Any]:
        now = self.elapsed()
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
        fired = check_stop(self.spec.stop, None, elapsed_s=self.elapsed(now), step=step)
        if fired is not None:
            self._stop(fired.describe())
            return
        live = [self.trainer_futures[i] for i in self.live_trainers()]
        if live and all(i in self.exited for i in self.live_trainers()):
            self._stop(self._natural_end())
        elif live and all(f.status == "finished" for f in live):
            # A trainer's last events and its task's completion travel separately: give the
            # events a moment to arrive before deciding why the job ended.
            self.finished_at = self.finished_at or now
            if now - self.finished_at > 5.0:
                self._stop(self._natural_end())
        elif any(self.idle) and now - self.last_heartbeat > self.spec.timeout / 4:
            # Idle trainers wait for the others' last blocks: keep their feed wait alive.
            self.last_heartbeat = now
            for i in self.live_trainers():
                if self.idle[i]:
                    self.feeds.append((i, self._pinned(
                        feed_block, None, address=self.roles["worker"][i],
                        key=f"dt-beat-{i}-{int(now * 1000)}", job=self.job, trainer=i,
                        seed=0, shuffle=False, seq=-1, epoch=-1, block=-2,
                    )))

    def _natural_end(self) -> str:
        if self.ledger.epochs_completed >= self.spec.epochs:
            return f"epochs={self.spec.epochs}"
        limits = [c for c in self.spec.stop if c.max_step is not None]
        return min(limits, key=lambda c: c.max_step or 0).describe() if limits else "trainers ended"

    def _stop(self, reason: str) -> None:
        if not self.stopped_by:
            self.stopped_by = reason
            logger.info("job %s stopping: %s", self.job, reason)

    # -- checkpoints ------------------------------------------------------------------------------
    def current_step(self) -> int:
        """The servers' step as last reported (scores, block events)."""
        return self.records[-1]["step"] if self.records else self.restore.step if self.restore else 0

    async def _checkpoint_step(self, now: float) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            return
        running = [i for i in self.live_trainers()
                   if self.trainer_futures[i].status == "pending"]
        workers = sorted({self.roles["worker"][i] for i in running})
        if ckpt.pending is None:
            if running and ckpt.due(step=self._reported_step(), now=now):
                await ckpt.request(workers)
            return
        if not running:
            await ckpt.release(workers)  # nothing left to pause: the final checkpoint covers it
            return
        if ckpt.ready(running):
            paused = ckpt.paused
            positions = {t: e.get("position") for t, e in paused.items()}
            ref = self.shards[0]
            # Every push is drained, so the servers' count is the checkpoint's exact step.
            step = (await self.client.run(_state.shard_version, self.job, ref.index,
                                          workers=[ref.address], asynchronous=True))[ref.address]
            if step <= ckpt.last_step:  # nothing new to save
                ckpt.skip()
                await ckpt.release(workers)
                return
            manifest = self.manifest(positions=positions, rng={t: e["rng"] for t, e in paused.items()},
                                     step=step)
            try:
                info = await ckpt.write(shards=self.shards, manifest=manifest, pinned=self._pinned)
            finally:
                await ckpt.release(workers)
            if info is not None:
                self.log.checkpoints.append(info)

    def _on_steps(self, trainer: int, steps: int) -> None:
        self.trainer_steps[trainer] = int(steps)

    def _reported_step(self) -> int:
        """The servers' step as best known here: scores, or the trainers' own push counts."""
        base = self.restore.step if self.restore is not None else 0
        if self.spec.strategy == "sync":
            pushed = max(self.trainer_steps.values(), default=base)
        else:
            pushed = base + sum(self.trainer_steps.values())
        return max(self.current_step(), pushed)

    def manifest(
        self, *, positions: dict[int, Any], rng: dict[int, str], step: int
    ) -> dict[str, Any]:
        """Everything but the tensors needed to resume exactly (JSON-able)."""
        samples = self.records[-1]["samples"] if self.records else 0
        return {
            "step": int(step), "samples": int(samples), "n_params": self.spec.n_params,
            "strategy": self.spec.strategy, "job_id": self.spec.job_id,
            "epoch": self.ledger.epochs_completed,
            "ledger": patch_positions(self.ledger.state(), positions),
            "rng": {str(k): v for k, v in rng.items()},
            "stop": [{"type": type(c).__name__, "state": c.state_dict()} for c in self.spec.stop],
            "records": self.records,
            "elapsed_s": self.elapsed(),
            "roles": {k: list(v) for k, v in self.roles.placement.items()},
            "config": {"optimizer": self.spec.optimizer, "lr": self.spec.lr,
                       "batch_size": self.spec.batch_size, "seed": self.spec.seed,
                       "epochs": self.spec.epochs, "grad_accumulation": self.spec.grad_accumulation},
        }

    async def final_checkpoint(self, trainers: list[dict[str, Any]], params_step: int,
                               samples: int) -> None:
        """The checkpoint of a job that stopped (not after a non-finite loss: keep the last good)."""
        if self.checkpointer is None or self.nan_stop:
            return
        rng = {int(t["trainer"]): t["rng"] for t in trainers if t.get("rng")}
        manifest = self.manifest(positions={}, rng=rng, step=params_step)
        manifest["samples"] = int(samples)
        info = await self.checkpointer.write(shards=self.shards, manifest=manifest,
                                             pinned=self._pinned)
        if info is not None:
            self.log.checkpoints.append({**info, "final": True})

    # -- stopping ---------------------------------------------------------------------------------
    async def finish(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """Stop every role (each wait bounded by the timeout); return the scorer's final answer."""
        client = self.client
        if self.checkpointer is not None:
            await self.checkpointer.release(self.roles.addresses)
        await run_on_live(client, _state.signal_stop, self.job, workers=self.roles.addresses)
        live = [self.trainer_futures[i] for i in self.live_trainers()]
        await self._wait(live, what="stopping the trainers")
        trainers = [await f for f in live]
        await self._drain_events()
        final = None
        if self.scorer_future is not None:
            await run_on_live(client, _state.signal_stop, self.job, scorer=True,
                              keep_step=self.stop_step, workers=self.roles["scorer"])
            await self._wait([self.scorer_future], what="the final score")
            final = await self.scorer_future
        return final, trainers

    async def _drain_events(self) -> None:
        """Take in the trainers' last events, so the ledger holds every block they reported."""
        deadline = time.monotonic() + min(10.0, self.spec.timeout)
        while not all(i in self.exited for i in self.live_trainers()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.warning("job %s: the last events of trainers %s did not arrive", self.job,
                               sorted(set(self.live_trainers()) - self.exited))
                return
            try:
                event = await asyncio.wait_for(self.events.get(), timeout=remaining)
            except asyncio.TimeoutError:
                continue
            self._on_event(event)
        while not self.events.empty():
            self._on_event(self.events.get_nowait())

    async def pull_parameters(self) -> tuple[np.ndarray, int, int]:
        """The final flat parameters, with the servers' step and sample counts."""
        futures = [
            self._pinned(_ps_server.pull_params_task, address=ref.address, key=f"dt-pull-{ref.index}",
                         job=self.job, index=ref.index)
            for ref in self.shards
        ]
        await self._wait(futures, what="pulling the final parameters")
        parts = await self.client.gather(futures, asynchronous=True)
        params = np.concatenate([p[0] for p in parts])
        return params, min(p[1] for p in parts), min(p[2] for p in parts)

    async def cleanup(self) -> None:
        self.client.unsubscribe_topic(self.topic)
        # unsubscribe_topic only tells the scheduler; the client keeps the handler, and with it
        # this controller, its blocks and role futures, for as long as the client lives.
        drop_topic_handler(self.client, self.topic)
        pending = [f for f in self.trainer_futures if f.status == "pending"]
        pending += [f for _, f in self.feeds if f.status == "pending"]
        if self.scorer_future is not None and self.scorer_future.status == "pending":
            pending.append(self.scorer_future)
        if pending:
            # Tasks pinned to a lost worker wait in no-worker forever: cancel them.
            await self.client.cancel(pending, asynchronous=True)
        self.trainer_futures, self.feeds, self.scorer_future = [], [], None
        alive = set((await self.client.scheduler.identity()).get("workers", {}))
        workers = [a for a in self.roles.addresses if a in alive]
        if workers:
            await self.client.run(_state.drop_job, self.job, workers=workers,
                                  asynchronous=True, on_error="ignore")


def history(log: JobLog) -> pd.DataFrame:
    """The job's score records as the history DataFrame."""
    return history_frame(log.records)
