"""A generation's end and the placing of the next: after a lost role (the state a restart starts
from, chosen by :func:`~dask_train.policy._restore.choose_restart`) or after a hand-over (the
state just handed over).

One object per job (:class:`Restarts`), which holds what the next generation starts from
(:attr:`Restarts.restore`: a resumed checkpoint, the survivors', a checkpoint's or copy's, a
hand-over's, or None for the initial parameters). The ``Restarting`` and ``HandingOver`` states
call it; the controller makes each generation's engine from its ``restore``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from distributed import Client

from dask_train.controller._checkpointing import Restore
from dask_train.controller._generations import GenerationPlacement
from dask_train.controller._keeping import StateKeeper
from dask_train.controller._reports import Reports
from dask_train.controller._state import JobLog, JobState, Phase
from dask_train.controller.cluster._departures import Departure, HandOvers
from dask_train.engines._protocol import Engine
from dask_train.policy._failure import Failure
from dask_train.policy._restore import Candidate, Source, choose_restart
from dask_train.runtime._calls import alive_workers

logger = logging.getLogger(__name__)


class Restarts:
    """The restarts of one job, and what its next generation starts from (see the module
    docstring).

    Parameters
    ----------
    client : distributed.Client
    state : JobState
    log : JobLog
        Its lost roles' records say what a restart started from and what it trains again.
    keeper : StateKeeper
        The job's checkpoints and copies (the stored state a restart may load).
    placement : GenerationPlacement
        Places the next generation's roles.
    reports : Reports
        A ``dt.run`` job's reports, given up with their generation.
    hand_overs : HandOvers
        The surviving ranks' state, and the record of a hand-over.
    """

    def __init__(self, client: Client, *, state: JobState, log: JobLog, keeper: StateKeeper,
                 placement: GenerationPlacement, reports: Reports,
                 hand_overs: HandOvers) -> None:
        self.client, self.state, self.log = client, state, log
        self.keeper, self.placement = keeper, placement
        self.reports, self.hand_overs = reports, hand_overs
        self.restore: Restore | None = None  # what the next generation's engine starts from

    def has_checkpoint(self) -> bool:
        """Whether a checkpoint exists to restart from (written by this fit, or resumed, or a
        copy in memory)."""
        return bool(self.log.checkpoints) or self.restore is not None or self.keeper.copied

    async def after_loss(self, engine: Engine, failure: Failure) -> None:
        """End this generation and place the next one on the live workers, from the newest
        state: the survivors', a checkpoint's or copy's, or the one this generation started
        from, else the initial parameters. Waits a little (at most 10 s) for the cluster to get
        back to its size: a nanny restarts a killed worker in about a second, and the new
        generation should use it; not when every lost worker left with notice (retired, it
        does not come back: a sync job stopped as rank 0 retired waited the 10 s for it).
        """
        self.state.enter(Phase.RESTARTING)
        self.reports.forget()  # its ranks are gone with their generation
        t0 = time.time()
        applied = sum(int(r.get("consumed", 0)) for r in engine.ledger_records())
        lost = set(engine.roles.addresses) - set(await alive_workers(self.client))
        noticed = bool(lost) and lost <= engine.leaving()  # retired: not coming back
        # The surviving ranks' state (sync), else the newest checkpoint (the one resumed from,
        # if none was written since), else the initial parameters: the next generation trains
        # again what was lost with them.
        # A report's copy being written is given up first: it would write through the engine
        # as the survivors' state does, and a live writer's state is the survivors' anyway.
        await self.reports.drop()
        survived = await self.hand_overs.from_survivors(engine, lost, manifest=self.keeper.manifest)
        await engine.close()
        which, stored = await self.keeper.stored(survivors=set(engine.roles.addresses) - lost)
        started = self.restore
        choice = choose_restart(survivors=_candidate(survived), stored=_candidate(stored),
                                started=_candidate(started), store=which, applied=applied)
        self.restore = {Source.SURVIVORS: survived, Source.STORED: stored,
                        Source.GENERATION: started, Source.INITIAL: None}[choice.source]
        redone = choice.redone
        # The restarting loss's record: others of its pass may come after it.
        record = next(r for r in reversed(self.log.failures) if r["role"] == failure.role)
        record["redone"] = redone
        record["from"] = choice.label
        alive = await self.placement.after_loss(retired=noticed)
        self._next_generation(await self.placement.enough(alive, lost), redone=redone)
        logger.warning("generation %d starts from %s on %s (%.2f s after %s was lost); %d "
                       "samples applied since are trained again", self.state.generation,
                       f"the surviving ranks' state at step {survived.step}" if survived else
                       self.restore.directory if self.restore else "the initial parameters",
                       self.placement.roles, time.time() - t0, failure.role, redone)

    async def after_departure(self, engine: Engine, departure: Departure) -> None:
        """End this generation (the leaving workers' roles stop, their hold ends) and place the
        next on the live workers, from the state just handed over."""
        self.state.enter(Phase.RESTARTING)
        self.reports.forget()
        await self.reports.drop()
        await engine.close()
        self.restore = departure.restore
        alive = await self.placement.after_departure(departure.workers)
        self._next_generation(await self.placement.enough(alive, departure.workers), redone=0)
        self.hand_overs.record(departure, roles=self.placement.roles.placement)

    def _next_generation(self, alive: Mapping[str, int], *, redone: int) -> None:
        """Place the next generation's roles on ``alive`` and enter its start; no pause of the
        generation before is written any more."""
        self.keeper.new_generation()
        self.placement.place_next(alive, redone=redone)


def _candidate(restore: Restore | None) -> Candidate | None:
    """A state a restart could start from, as the restart policy reads it."""
    if restore is None:
        return None
    return Candidate(step=restore.step, samples=int(restore.manifest.get("samples", 0)))
