"""A ``dt.run`` job's reports: the checkpoint each one carries, then its ranks let go on.

A ``dt.run`` job's ranks, not a schedule, say when to checkpoint (``ctx.report(checkpoint=...)``):
its engine (a :class:`~dask_train.engines._protocol.Reporting` one) hands the
controller a :class:`~dask_train.engines._events.ReportReady` once every rank it waits for has
reported, every one of them waiting there. :class:`Reports` holds that report until the
controller's next pass, writes the checkpoint it carries to ``checkpoint=``'s store (or hands the
job over from it when a rank's worker is leaving, :class:`~._departures.HandOvers`), lets the
ranks go on, and, for a job without ``checkpoint=`` whose state one worker alone holds, keeps a
copy of that state in the controller's in-memory copies while the ranks go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from distributed import Client

from dask_train.controller._checkpointing import Checkpoints
from dask_train.controller._state import JobLog, JobState
from dask_train.controller.cluster._departures import Departure, HandOvers, Manifest
from dask_train.engines._events import ReportReady
from dask_train.engines._protocol import Engine, Reporting
from dask_train.errors import WorkerLost
from dask_train.runtime._calls import alive_workers

logger = logging.getLogger(__name__)


class Reports:
    """The reports of one ``dt.run`` job, across its generations (see the module docstring).

    Parameters
    ----------
    client : distributed.Client
    state : JobState
        The job's phases and checkpoint times (the report's checkpoint is one of the job's).
    log : JobLog
        Receives each checkpoint written (``log.checkpoints``).
    checkpoints : Checkpoints or None
        ``checkpoint=``'s store; None when the job has none.
    hand_overs : HandOvers
        The job's hand-overs: a regroup waits for the ranks' next report with a checkpoint.

    The controller's ``manifest(ledger, rng)``, its in-memory copies and what marks a copy
    written are passed per call, as to :class:`~._departures.HandOvers`: held here, the
    controller's bound methods would make a cycle that keeps a finished job's blocks alive
    until the next garbage collection.

    Examples
    --------
    The controller's pass, once its checkpoints are looked at::

        departure = await reports.step(engine, manifest=manifest, copies=copies,
                                       copied=mark_copied)
    """

    def __init__(self, client: Client, *, state: JobState, log: JobLog,
                 checkpoints: Checkpoints | None, hand_overs: HandOvers) -> None:
        self.client, self.state, self.log = client, state, log
        self.checkpoints, self.hand_overs = checkpoints, hand_overs
        # A report every rank of a dt.run job made and waits on (its checkpoint, then resume).
        self.pending: ReportReady | None = None
        self.copy: asyncio.Task[None] | None = None  # a dt.run report's copy being written

    def take(self, event: ReportReady) -> None:
        """Every rank made report ``event.id`` and waits on it: acted on at :meth:`step`."""
        self.pending = event

    def forget(self) -> None:
        """The generation ends: the report its ranks wait on goes with them."""
        self.pending = None

    async def step(self, engine: Engine, *, manifest: Manifest, copies: Checkpoints | None,
                   copied: Callable[[], None]) -> Departure | None:
        """Every rank reported (its score is in): write the checkpoint it carries, let them go
        on; or, when a worker is leaving, hand the job over from it (the ranks stay at their
        report until the generation ends).

        ``copies`` is the controller's in-memory copies (None: none kept), ``copied`` called
        once a report's copy is written there (see :meth:`_copy`).
        """
        report, self.pending = self.pending, None
        if report is None:
            return None
        if report.checkpoint and self.hand_overs.awaiting is None and \
                not await self._write(engine, report, manifest=manifest) and \
                self.hand_overs.pending(engine):
            # A rank's worker gave notice while the report was written: hand over from this
            # report, which the ranks still hold (by the next one the worker may be gone).
            await self.hand_overs.hand_over(engine, await alive_workers(self.client),
                                            manifest=manifest)
        if report.checkpoint and self.hand_overs.awaiting is not None:
            departure = await self.hand_overs.at_report(engine, report.id, manifest=manifest)
            if departure is not None:
                return departure
        await engine.resume(report.id)
        if report.checkpoint:
            self._copy(engine, manifest=manifest, copies=copies, copied=copied)
        return None

    async def at_finish(self, engine: Engine, *, drain: Callable[[], bool],
                        manifest: Manifest) -> None:
        """As the job finishes: the checkpoint of the report every rank waits on, if any, is
        the job's last. ``drain()`` takes the controller's next queued event (False: none
        left), which may be that report (:meth:`take`)."""
        if not isinstance(engine, Reporting):
            return
        # A stop decided while every rank waits on a report (its score stopped the job):
        # the checkpoint it carries is the job's last.
        while self.pending is None and drain():
            pass
        report, self.pending = self.pending, None
        if report is not None and report.checkpoint:
            await self._write(engine, report, manifest=manifest)

    async def _write(self, engine: Engine, report: ReportReady, *, manifest: Manifest) -> bool:
        """Write the checkpoint the ranks reported to ``checkpoint=``'s store (they wait,
        paused, until it is written). False: not written because a rank's worker left."""
        snapshot = engine.paused(report.id)
        if self.checkpoints is None or snapshot is None:
            return True
        try:
            info = await self.checkpoints.write(
                engine, self.state, manifest(snapshot.ledger, snapshot.rng),
                step=snapshot.step, generation=self.state.generation, pause_s=0.0)
        except WorkerLost as exc:
            # The next look at the roles acts on the loss, from the checkpoint before.
            logger.warning("checkpoint at step %d abandoned: %s", snapshot.step, exc)
            return False
        if info is not None:
            self.log.checkpoints.append(info)
        return True

    def _copy(self, engine: Engine, *, manifest: Manifest, copies: Checkpoints | None,
              copied: Callable[[], None]) -> None:
        """Start writing a copy of the newest report's state when one worker alone holds it (a
        ``dt.run`` job without ``checkpoint=`` whose state only rank 0 passes): its worker's
        loss then costs what was trained since that report, not the run. Written while the
        ranks go on (written at the report, with the ranks waiting there, a worker retired
        meanwhile was gone before the hand-over could take the next report); one at a time,
        a report that comes while one is written is copied at the next."""
        if copies is None or not isinstance(engine, Reporting) or \
                self.copy is not None and not self.copy.done():
            return
        held = engine.report_copy()
        if held is None:
            return
        snapshot, version = held
        kept = manifest(snapshot.ledger, snapshot.rng)
        kept["records"] = list(kept["records"])  # as at the report, not at the write
        store = copies

        async def write() -> None:
            try:
                info = await store.write(engine, self.state, kept, step=snapshot.step,
                                         generation=self.state.generation, pause_s=0.0,
                                         version=version)
            except Exception as exc:  # noqa: BLE001 - the copy before stays the newest
                logger.info("the copy of the report at step %d was not kept: %s: %s",
                            snapshot.step, type(exc).__name__, exc)
                return
            if info is not None:
                copied()

        self.copy = asyncio.get_running_loop().create_task(write())

    async def drop(self) -> None:
        """Cancel a report's copy still being written (its files without a manifest are not
        a checkpoint, and go with the store)."""
        task, self.copy = self.copy, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
