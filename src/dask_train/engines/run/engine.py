"""The ``dt.run`` engine, client side: the user's function on one rank per worker, in a torch
process group, fed by the ledger, reporting through ``ctx.report``.

It is the synchronous engine with the user's function in place of the library's loop: the same
process group (gloo, or NCCL on GPUs), block grants, role watching and restarts. What differs:
the ranks, not the controller, say when to checkpoint (at a ``ctx.report(checkpoint=...)``, every
rank waiting there), the scores come from the ranks' reports (no scorer), and the result is what
each rank's function returned instead of parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from distributed import Client

from dask_train.checkpoint._sharded import adopt_sharded
from dask_train.data._blocks import BlockSet
from dask_train.engines._events import (
    Paused,
    Reported,
    ReportReady,
    Score,
    ShareDone,
    from_message,
)
from dask_train.engines._protocol import Emit, Ending, Reporting, Snapshot
from dask_train.engines._spec import JobSpec, RoleConfig
from dask_train.engines.harness import control as worker_side
from dask_train.engines.holders.ref import ShardRef
from dask_train.engines.roles.waiting import raise_role_error
from dask_train.engines.run.context import RunSettings
from dask_train.engines.run.rank import run_user_rank
from dask_train.engines.torch_sync.engine import TorchSyncEngine
from dask_train.errors import RoleFailed
from dask_train.policy._failure import Failure
from dask_train.policy._placement import Roles
from dask_train.runtime._calls import run_on_live
from dask_train.runtime._cluster_view import ClusterView, look
from dask_train.runtime._hosts import local_ranks
from dask_train.runtime._torch_group import _collateral

logger = logging.getLogger(__name__)

_COMBINE: dict[str, Callable[[list[float]], float]] = {
    "mean": lambda v: sum(v) / len(v), "sum": sum, "min": min, "max": max}


class RunEngine(TorchSyncEngine, Reporting):
    """One generation of a ``dt.run`` job (see the module docstring).

    Parameters
    ----------
    client, spec, roles, blocks, job, restore
        As for every role engine; ``blocks`` may hold no block (a job without data).
    fn_blob : bytes
        The user's function, pickled by value.
    run : RunSettings
        What every rank receives; the group's store and local ranks are filled in at start.
    user_config : mapping
        The keyword arguments of the function.
    """

    strategy = "run"

    def __init__(self, client: Client, spec: JobSpec, roles: Roles, blocks: BlockSet, *,
                 job: str, restore: Mapping[str, Any] | None, fn_blob: bytes, run: RunSettings,
                 user_config: Mapping[str, Any]) -> None:
        super().__init__(client, spec, roles, blocks, None, job=job, restore=restore)
        self.fn_blob, self.run, self.user_config = fn_blob, run, dict(user_config)
        self.reports: dict[int, dict[int, Reported]] = {}
        self.ready: set[int] = set()  # reports handed to the controller, until it resumes them
        self.base_samples = int(restore["samples"]) if restore is not None else 0
        self.report_samples: dict[int, int] = {}
        self.peer_errors: dict[int, str] = {}  # rank -> what it got from a lost peer ("" none)
        # rank -> (epoch, its report count) when it read its whole share of that epoch: the
        # reports the others make inside that epoch's batch loop after that do not wait for it.
        self.share_done: dict[int, tuple[int, int]] = {}
        # The sharded state (DCP) every rank of a ready report wrote, for save to adopt.
        self.sharded: Reported | None = None
        self.writer = 0  # the rank whose report holds the state a checkpoint writes
        # The newest ready report whose state ranks hold in memory (not sharded): its
        # snapshot, samples and each holding rank's steps, what a job goes on from when a rank
        # is killed (survivors). Saved with the report's samples then (saving_samples).
        self.held_report: tuple[Snapshot, int, dict[int, int]] | None = None
        self.saving_samples: int | None = None

    def make_shards(self) -> list[ShardRef]:
        """None: each rank keeps its own model; the state a report holds is the writer's."""
        return []

    @property
    def writer_address(self) -> str:
        """The worker of the rank holding the newest reported checkpoint's state (rank 0 until
        a report says otherwise): the one that writes it."""
        return str(self.roles["trainer"][self.writer])

    async def start(self, emit: Emit) -> None:
        """Start the process group, then every rank's function; grant the first blocks."""
        self.emit = emit
        await self.start_servers()
        self.config = self.trainer_config()
        self.client.subscribe_topic(self.topic, lambda event: self._on_event(event[1]))
        # The base's close unsubscribes (and forgets the handler, with this engine) only when
        # told: without it the client kept every dt.run job's engine, and the scheduler its
        # topic, for the client's life.
        self.subscribed = True
        ranks = self.roles["trainer"]
        run = RunSettings(**{**self.run.__dict__, "local_ranks": tuple(local_ranks(ranks)),
                             "master": self.group.master if self.group is not None else "",
                             "block_rows": tuple(b.rows for b in self.blocks.blocks),
                             "may_grow": self.spec.trainer_cap is None or self.spec.trainer_cap > 1})
        for i, address in enumerate(ranks):
            self.trainer_futures.append(self.pinned(
                run_user_rank, self.fn_blob, address=address, key=f"dt-rank-{i}", job=self.job,
                index=i, config=self.config, run=run,
                user_config=self.user_config, resources=self.spec.placement.task_resources))
        if not self.blocks.blocks:
            return  # no data: nothing to grant (the ledger would plan empty epochs forever)
        for _ in range(self.spec.blocks_ahead):
            for i in range(len(ranks)):
                self.granter.grant(i)

    # -- reports ----------------------------------------------------------------------------------
    def _on_event(self, message: dict[str, Any]) -> None:
        if message.get("kind") == ShareDone.kind:
            done = from_message(message)
            assert isinstance(done, ShareDone)
            self.share_done[done.trainer] = (done.epoch, done.reports)
            for report_id in sorted(self.reports):
                self._ready(report_id)
            return
        if message.get("kind") != Reported.kind:
            super()._on_event(message)
            return
        event = from_message(message)
        assert isinstance(event, Reported)
        self.trainer_steps[event.trainer] = event.steps
        self.reports.setdefault(event.id, {})[event.trainer] = event
        # The snapshot of a checkpoint reads the ranks' positions as a pause's.
        self.pauses.setdefault(event.id, {})[event.trainer] = Paused(
            trainer=event.trainer, id=event.id, steps=event.steps, position=event.position,
            rng=event.rng)
        self._ready(event.id)

    def awaited(self, report_id: int) -> list[int]:
        """The ranks report ``report_id`` waits for: the running ones, less those whose share of
        the epoch the report was made in ran out before it."""
        got = self.reports.get(report_id, {})
        # A report inside an epoch's batch loop carries that epoch (the next to restart from).
        epoch = next((e.next_epoch for e in got.values() if isinstance(e, Reported)), None)
        return [i for i in self._running()
                if not (i in self.share_done and self.share_done[i][0] == epoch
                        and self.share_done[i][1] < report_id)]

    def _ready(self, report_id: int) -> None:
        """Once every expected rank made report ``report_id``: its score, then ReportReady."""
        got = self.reports.get(report_id, {})
        if report_id in self.ready or not got or \
                not all(i in got for i in self.awaited(report_id)):
            return
        self.ready.add(report_id)
        ranks = sorted(got)
        first = got[ranks[0]]
        samples = self.base_samples + sum(e.samples for e in got.values())
        self.report_samples[report_id] = samples
        metrics = _combine([got[i] for i in ranks], first.reduce)
        if metrics:
            self.emit(Score(step=first.steps, samples=samples, metrics=metrics,
                            nonfinite=[k for k, v in metrics.items() if not math.isfinite(v)],
                            wall=time.time(), worker=self.roles["trainer"][ranks[0]]))
        writer = next((i for i in ranks if got[i].checkpoint), None)
        if writer is not None:
            self.writer = writer
            self.sharded = got[writer] if got[writer].sharded else None
            # Every rank waits at this report: the ledger is exactly where it was made.
            snapshot = self.paused(report_id)
            if snapshot is not None and self.sharded is None:
                # Every rank that passed the state holds it (DDP's ranks hold the same): any
                # one of them left alive is enough to go on from this report.
                self.held_report = (snapshot, samples,
                                    {i: got[i].steps for i in ranks if got[i].checkpoint})
        self.emit(ReportReady(id=report_id, checkpoint=writer is not None))

    def epochs_completed(self) -> int:
        """Epochs every row of which was read (none for a job without data)."""
        return super().epochs_completed() if self.blocks.blocks else 0

    def reported_step(self) -> int:
        """The steps rank 0 last reported (restored steps included)."""
        base = int(self.restore["step"]) if self.restore is not None else 0
        return int(self.trainer_steps.get(0, max(self.trainer_steps.values(), default=base)))

    async def exact_step(self) -> int:
        """As reported: the ranks wait at their report while a checkpoint is written."""
        return self.reported_step()

    def trainer_config(self) -> RoleConfig:
        """As the sync engine's, with where a sharded checkpoint's parts are."""
        config = super().trainer_config()
        sharded = None if self.restore is None else self.restore.get("sharded")
        if sharded and config.restore is not None:
            config = dataclasses.replace(config, restore={**config.restore, "sharded": sharded})
        return config

    async def save(self, *, directory: str, paths: Callable[[int], str],
                   metadata: Mapping[str, str]) -> list[dict[str, Any]]:
        """The reporting rank writes the state it holds, or every rank's sharded state (written
        already) moves into the checkpoint; the samples are the job's, not a rank's."""
        samples = self.saving_samples if self.saving_samples is not None else \
            max(self.report_samples.values(), default=self.base_samples)
        report, self.sharded = self.sharded, None
        if report is not None:
            name = f"sharded-r{report.id}"
            # Renamed on a local disk, copied on an object store: the manifest written after
            # this lists the files, and only a checkpoint holding them all is complete.
            files = await asyncio.get_running_loop().run_in_executor(
                None, adopt_sharded, report.sharded, f"{directory.rstrip('/')}/{name}",
                dict(self.spec.checkpoint.storage_options or {}) if self.spec.checkpoint else {})
            return [{"version": self.reported_step(), "samples": samples, "finite": True,
                     "index": 0, "start": 0, "stop": 0,
                     "sharded": {"dir": name, "format": "torch.distributed.checkpoint",
                                 "next_epoch": report.next_epoch, "files": files}}]
        # The writer's reported state, as the job writes every checkpoint's tensors: one file,
        # index 0 (the format a Trainer's sync job writes, with no parameter range).
        written = await self.tasks.write_holders(
            [(0, self.writer_address, {**metadata, "start": "0", "stop": "0"})],
            paths=paths, directory=directory)
        return [{**written[0], "samples": samples, "index": 0, "start": 0, "stop": 0}]

    async def survivors(self, lost: set[str]) -> Snapshot | None:
        """The last ready report's state, when a rank that reported it (the writer, or another
        rank that passed the same state) is alive and still holds it (a later report's state
        replaces it only once every rank made that one): written as that report's checkpoint,
        the job goes on from it, without ``checkpoint=`` too. What was trained since the report
        is trained again."""
        if self.held_report is None:
            return None
        snapshot, samples, holders = self.held_report
        ranks = sorted(holders, key=lambda i: (i != self.writer, i))
        for rank in ranks:
            address = str(self.roles["trainer"][rank])
            if address in lost:
                continue
            held = await run_on_live(self.client, worker_side.shard_version, self.job, 0,
                                     workers=[address], leaving=self.leaving_workers)
            if held.get(address) == holders[rank]:
                self.writer = rank
                self.sharded, self.saving_samples = None, samples
                return snapshot
        return None

    def report_copy(self) -> tuple[Snapshot, int] | None:
        """The newest report's state and its writer's steps, when the writer's worker alone
        holds it (no other rank's worker passed the same state)."""
        if self.held_report is None:
            return None
        snapshot, _, holders = self.held_report
        ranks = self.roles["trainer"]
        if len({ranks[i] for i in holders}) > 1 or self.writer not in holders:
            return None
        return snapshot, holders[self.writer]

    def default_holders(self) -> Mapping[str, str]:
        """The rank whose reported state a checkpoint writes."""
        return {self.writer_address: f"rank {self.writer} (its reported state)"}

    # -- failures ---------------------------------------------------------------------------------
    async def failures(self, view: ClusterView) -> list[Failure]:
        """Lost workers first (those ``view``, the controller's listing of this pass, no longer
        has); a rank's own error ends the job with its traceback, and an error a rank got from
        a lost peer ("Connection closed by peer") waits for the loss to show in a newer
        listing."""
        lost = self._lost(view)
        if lost or not await self._troubled():
            return lost
        deadline = time.monotonic() + 3.0
        while True:
            troubled = await self._troubled()
            own = [i for i, exc in troubled.items() if exc is not None and not _collateral(exc)]
            if own or time.monotonic() > deadline:
                i = own[0] if own else min(troubled)
                fut = self.trainer_futures[i]
                where = f"rank {i} on {self.roles['trainer'][i]}"
                if fut.status == "error":
                    await raise_role_error(fut, where)
                raise RoleFailed(f"{where} lost a peer ({self.peer_errors[i]}), but no worker "
                                 "left the cluster: see the other ranks' worker logs")
            await asyncio.sleep(0.2)
            lost = self._lost(await look(self.client))
            if lost:
                return lost

    async def _troubled(self) -> dict[int, BaseException | None]:
        """Ranks that failed: their exception, or None for a rank that returned after losing a
        peer (see ``run_user_rank``)."""
        out: dict[int, BaseException | None] = {}
        for i in self.live():
            fut = self.trainer_futures[i]
            if fut.status == "error":
                out[i] = await fut.exception()
            elif fut.status == "finished":
                if i not in self.peer_errors:
                    result = await fut
                    self.peer_errors[i] = result.get("lost_peer", "")
                if self.peer_errors[i]:
                    out[i] = None
        return out

    def _lost(self, view: ClusterView) -> list[Failure]:
        gone = view.lost(self.roles.get("trainer", []))
        return [Failure("trainer", i, address, f"the Dask worker {address} left the cluster")
                for i, address in enumerate(self.roles.get("trainer", [])) if address in gone]

    # -- ending -----------------------------------------------------------------------------------
    async def stop(self, *, keep_step: int | None) -> Ending:
        """Tell the ranks the job is stopping (their ``should_stop`` and feeds say so), wait for
        their functions to return, and hand back what each returned."""
        self.granter.stopping = True
        await run_on_live(self.client, worker_side.signal_stop, self.job,
                          workers=self.roles.addresses)
        live = [self.trainer_futures[i] for i in self.live()]
        await self.tasks.wait(live, what="waiting for the ranks' functions to return")
        ranks = [await f for f in live]
        await self._drain_events()
        return Ending(params=None, steps=max((r["steps"] for r in ranks), default=0),
                      samples=self.base_samples + sum(r["samples"] for r in ranks),
                      trainers=ranks, rng={str(r["trainer"]): r["rng"] for r in ranks})

    async def close(self) -> None:
        """Close the generation; drop sharded states its ranks wrote that no checkpoint took."""
        await super().close()
        root = self.run.sharded_root
        if root:
            options = dict(self.spec.checkpoint.storage_options or {}) if self.spec.checkpoint \
                else {}
            await asyncio.get_running_loop().run_in_executor(
                None, _drop_staged, f"{root}/{self.job}-r*", options)


def _drop_staged(pattern: str, options: dict[str, Any]) -> None:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(pattern, **options)
    for leftover in fs.glob(path):
        with contextlib.suppress(FileNotFoundError):
            fs.rm(leftover, recursive=True)
        logger.info("removed %s: a sharded state no checkpoint took", leftover)


def _combine(events: list[Reported], reduce: str | None) -> dict[str, float]:
    """The report's metrics: the first rank's, or every rank's combined by ``reduce``."""
    if reduce is None:
        return dict(events[0].metrics)
    names = [k for k in events[0].metrics if all(k in e.metrics for e in events)]
    return {k: float(_COMBINE[reduce]([e.metrics[k] for e in events])) for k in names}
