"""Where a job's state is kept while it runs: ``checkpoint=``'s store and the in-memory copies.

One object per job (:class:`StateKeeper`), the controller's one place for them: whether a job
keeps copies in memory and where (:func:`~dask_train.policy._copies.copies_wanted`,
:func:`~dask_train.controller.cluster._memory.memory_store`), when a checkpoint or a copy is
due, the pause that writes it (RUNNING -> CHECKPOINTING -> RUNNING), the final checkpoint, which
store a restart loads from (:func:`~dask_train.policy._restore.restart_store`), and dropping the
copies once ``checkpoint=`` holds one or the job ends. The controller decides when a generation
starts, restarts or ends; this object only keeps what it needs to start from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from distributed import Client

from dask_train.controller._checkpointing import Checkpoints, Restore
from dask_train.controller._generations import GenerationPlacement
from dask_train.controller._state import CheckpointTimes, JobLog, JobState, Phase
from dask_train.controller.cluster._memory import (
    COPIES,
    drop_store,
    in_workers,
    memory_store,
    on_this_machine,
    rehold,
)
from dask_train.engines._protocol import Ending, Engine, Reporting, Survivable
from dask_train.engines._spec import JobSpec
from dask_train.errors import WorkerLost
from dask_train.policy._copies import copies_wanted
from dask_train.policy._restore import Store, restart_store
from dask_train.runtime._calls import alive_workers

logger = logging.getLogger(__name__)


class StateKeeper:
    """Keeps one job's state: its checkpoints and, where a lost server would take the only copy
    of it, copies in memory (see the module docstring).

    Parameters
    ----------
    client : distributed.Client
    spec : JobSpec
    state, log : JobState, JobLog
        The job's phases and checkpoint times, and its log (the checkpoints written, the
        history a manifest carries).
    placement : GenerationPlacement
        Where the job's generations run (a manifest names the current roles).
    """

    def __init__(self, client: Client, spec: JobSpec, *, state: JobState, log: JobLog,
                 placement: GenerationPlacement) -> None:
        # Nothing here points back at the controller: a cycle through it would keep a
        # generation's futures on the client until the collector ran.
        self.client, self.spec, self.state, self.log = client, spec, state, log
        self.placement = placement
        self.checkpoints = Checkpoints(spec.checkpoint, timeout=spec.timeout) \
            if spec.checkpoint is not None else None
        # A job whose servers hold the only copy of its state keeps a copy of it in memory
        # every few seconds while it has no checkpoint: a killed server costs seconds, not the
        # run, with checkpoint= set or not. Made at the first generation that needs it, beside
        # checkpoint=, on a schedule of its own.
        self.copies: Checkpoints | None = None
        self.copied = False  # a copy was written: a restart may start from it
        self.copy_times = self.state if self.checkpoints is None else CheckpointTimes()
        self.pausing_for: Checkpoints | None = None  # the store the current pause writes to
        self.resumed = False  # the job went on from checkpoint='s newest

    def manifest(self, ledger: dict[str, Any], rng: Mapping[str, str]) -> dict[str, Any]:
        """Everything but the tensors needed to resume exactly (JSON-able)."""
        spec = self.spec
        return {
            "n_params": spec.n_params, "strategy": spec.strategy, "job_id": spec.job_id,
            "ledger": ledger, "rng": dict(rng),
            "stop": [{"type": type(c).__name__, "state": c.state_dict()} for c in spec.stop],
            "records": self.log.records, "elapsed_s": self.log.elapsed(),
            "roles": self.placement.roles.placement,
            "config": spec.manifest_config(),
        }

    # -- a job's start and end ---------------------------------------------------------------------
    def load_resumed(self) -> Restore | None:
        """``resume=True``: checkpoint='s newest, or None (none there, or no ``checkpoint=``)."""
        if self.checkpoints is None:
            return None
        restore = self.checkpoints.load(n_params=self.spec.n_params, strategy=self.spec.strategy)
        self.resumed = restore is not None
        return restore

    async def prepare(self, engine: Engine, workers: Iterable[str]) -> None:
        """A generation's start: keep copies of the state in memory for a job that could
        otherwise only restart from its initial parameters: an engine the controller pauses for
        checkpoints whose trainers do not hold the state themselves (async-ps: a server's shard
        is its only copy), every ``JobSpec.copy_every_s``, without ``checkpoint=`` or until its
        first checkpoint is written. Where: memory that a worker's death does not take
        (:func:`memory_store`): ``/dev/shm`` when every worker is on this machine, else two live
        workers' memory among ``workers`` (the generation's), chosen again at each generation."""
        every = self.spec.copy_every_s
        # A dt.run job's copies are of its reports, written after its ranks went on (see
        # Reports._copy).
        if not copies_wanted(every, schedules_checkpoints=not isinstance(engine, Reporting),
                             recovers_from_survivors=isinstance(engine, Survivable),
                             has_checkpoint_store=self.checkpoints is not None,
                             checkpointed=self.checkpointed):
            return
        if self.copies is None:
            self.copies = memory_store(
                COPIES, self.spec.job_id, workers=workers,
                alive=await alive_workers(self.client), timeout=self.spec.timeout,
                memory_state=self.spec.memory_state, every_seconds=every, keep=1)
        elif in_workers(self.copies):
            self.copies = rehold(self.copies, alive=await alive_workers(self.client),
                                 workers=workers)

    async def close(self) -> None:
        """The job's end: its in-memory copies go (checkpoint='s store stays)."""
        if self.copies is not None:
            await asyncio.to_thread(drop_store, self.copies)

    def mark_copied(self) -> None:
        """A copy was written outside a pause (a ``dt.run`` report's: see :class:`Reports`)."""
        self.copied = True

    @property
    def checkpointed(self) -> bool:
        """Whether ``checkpoint=``'s store holds a checkpoint of this job (written by this fit,
        or resumed from): its in-memory copies are then no longer needed."""
        return self.checkpoints is not None and (bool(self.log.checkpoints) or self.resumed)

    # -- a pause that writes a checkpoint or a copy ------------------------------------------------
    def due(self, engine: Engine, now: float) -> Checkpoints | None:
        """The store a checkpoint is due in now: ``checkpoint=``'s on its schedule, else the
        in-memory copies on theirs while no checkpoint exists."""
        step = engine.reported_step()
        if self.checkpoints is not None and self.checkpoints.due(self.state, step=step, now=now):
            return self.checkpoints
        copies = self.copies
        if copies is None or self.checkpointed or \
                not in_workers(copies) and not on_this_machine(engine.roles.addresses):
            return None  # a worker of another machine joined: it could not write its shard here
        return copies if copies.due(self.copy_times, step=step, now=now) else None

    async def step(self, engine: Engine, now: float) -> None:
        """One pass's work: start a pause when a checkpoint or copy is due, write it once every
        trainer is paused, then end the pause."""
        state = self.state
        if isinstance(engine, Reporting) or self.checkpoints is None and self.copies is None:
            return
        if state.phase is Phase.RUNNING:
            # Not once a stop is decided (in this same pass): the final checkpoint follows.
            ckpt = self.due(engine, now) if engine.running() and not state.stopped_by else None
            if ckpt is not None:
                self.pausing_for = ckpt
                state.enter(Phase.CHECKPOINTING)
                state.pause_id, state.next_pause_id = state.next_pause_id, state.next_pause_id + 1
                state.pause_started = now
                await engine.pause(state.pause_id)
                if ckpt is self.copies and in_workers(ckpt):
                    # A holder without a role may have left since the generation began.
                    self.copies = self.pausing_for = rehold(
                        ckpt, alive=await alive_workers(self.client),
                        workers=engine.roles.addresses)
            return
        if not engine.running():  # nothing left to pause: the final checkpoint covers it
            await self.end_pause(engine)
            return
        snapshot = engine.paused(state.pause_id)
        ckpt = self.pausing_for or self.checkpoints or self.copies
        assert ckpt is not None
        if snapshot is None:
            ckpt.check_pause_time(state, now)
            return
        times = state if ckpt is self.checkpoints else self.copy_times
        try:
            # Every push is drained and every trainer paused: the engine's count is exact.
            step = await engine.exact_step()
            info = None
            if step > times.last_checkpoint_step:
                try:
                    info = await ckpt.write(engine, times,
                                            self.manifest(snapshot.ledger, snapshot.rng),
                                            step=step, generation=state.generation,
                                            pause_s=now - state.pause_started,
                                            written=lambda: self.end_pause(engine))
                except WorkerLost as exc:
                    # The next look at the roles acts on the loss, from the checkpoint before.
                    logger.warning("checkpoint at step %d abandoned: %s", step, exc)
            else:
                times.last_checkpoint_time = time.time()  # nothing new to save
        finally:
            self.pausing_for = None
            await self.end_pause(engine)
        if info is not None and ckpt is self.checkpoints:
            self.log.checkpoints.append(info)
            await self._drop_copies()
        self.copied = self.copied or info is not None and ckpt is self.copies

    async def end_pause(self, engine: Engine) -> None:
        """End the current pause, if one runs: the trainers go on."""
        if self.state.phase is Phase.CHECKPOINTING:
            await engine.resume(self.state.pause_id)
            self.state.pause_id = 0
            self.state.enter(Phase.RUNNING)

    def new_generation(self) -> None:
        """A new generation's roles: no pause of the one before is written any more."""
        self.pausing_for = None

    async def final(self, engine: Engine, ending: Ending) -> None:
        """The job's final checkpoint, in ``checkpoint=``'s store, once its roles stopped."""
        if self.checkpoints is None or self.state.nan_stop or isinstance(engine, Reporting):
            return
        manifest = self.manifest(engine.ledger_state(), ending.rng)
        try:
            info = await self.checkpoints.write(engine, self.state, manifest, step=ending.steps,
                                                generation=self.state.generation, pause_s=0.0)
        except WorkerLost as exc:
            # The job is done and its parameters are in hand: a holder that left now costs
            # the final checkpoint only (the one before stays the newest).
            logger.warning("the final checkpoint was not written: %s", exc)
            return
        if info is not None:
            self.log.checkpoints.append({**info, "final": True})

    async def _drop_copies(self) -> None:
        """Drop the in-memory copies kept beside ``checkpoint=`` once its first checkpoint is
        written: it is newer, and survives what they would."""
        if self.copies is not None and self.checkpoints is not None:
            copies, self.copies, self.copied = self.copies, None, False
            await asyncio.to_thread(drop_store, copies)

    # -- a restart ---------------------------------------------------------------------------------
    async def stored(self, *, survivors: Iterable[str]) -> tuple[Store, Restore | None]:
        """What a restart could load: the store it reads (the copies in memory until
        ``checkpoint=`` holds one, then the checkpoints) and that store's newest state, if any.
        Copies held in workers' memory are read from those of ``survivors`` still alive."""
        if in_workers(self.copies):
            assert self.copies is not None
            self.copies = rehold(self.copies, alive=await alive_workers(self.client),
                                 workers=survivors)
        which = restart_store(copied=self.copied, checkpointed=self.checkpointed,
                              has_checkpoint_store=self.checkpoints is not None)
        store = self.copies if which is Store.COPIES else self.checkpoints
        loaded = None if store is None else store.load(n_params=self.spec.n_params,
                                                       strategy=self.spec.strategy)
        return which, loaded
