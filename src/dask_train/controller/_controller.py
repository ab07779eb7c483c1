"""The one controller: runs any engine (:class:`~dask_train.engines._protocol.Engine`) to the job's end.

One coroutine on the client's event loop. Per generation it starts the engine, then loops: take
the engine's events (scores, non-finite losses, epochs, progress) into the history, the stop
conditions and the callbacks (:class:`~._history.JobHistory`); ask the engine for periodic work;
take checkpoints and in-memory copies (:class:`~._keeping.StateKeeper`, through the engine's
pause/snapshot/save); hand over from workers that leave with notice and, every second, look for
lost or failed roles and joined workers (:class:`~.cluster._liveness.Liveness`), acting as the
pure failure policy decides (continue, replace the scorer, restart a new generation from the
newest checkpoint, or raise: :class:`~._restarts.Restarts`). The job moves between the states
of :mod:`._states` (starting, running, restarting, handing over, finishing, finished, errored),
each state's step doing its work through those objects and the three steps here (a
generation's engine made, started, finished); phases live in one explicit
:class:`~._state.JobState`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from distributed import Client

from dask_train.controller._generations import GenerationPlacement, PlanRoles
from dask_train.controller._history import JobHistory
from dask_train.controller._hook_thread import CallbackThread, job_failed
from dask_train.controller._interrupt import RunGuard, interrupted
from dask_train.controller._keeping import StateKeeper
from dask_train.controller._publish import JobEvents
from dask_train.controller._reports import Reports
from dask_train.controller._restarts import Restarts
from dask_train.controller._state import JobLog, JobState, Phase
from dask_train.controller._states import Errored, Finished, Outcome, Starting, State
from dask_train.controller.cluster._departures import HandOvers
from dask_train.controller.cluster._liveness import Liveness
from dask_train.controller.cluster._losses import Losses
from dask_train.controller.cluster._wanted import WantedWorkers
from dask_train.engines._protocol import Ending, Engine, Reporting
from dask_train.engines._spec import JobSpec
from dask_train.errors import release_frames
from dask_train.policy._failure import Failure
from dask_train.policy._placement import Roles
from dask_train.runtime._quiet_logs import quiet_job

logger = logging.getLogger(__name__)


#: Builds a generation's engine: (roles, job key, restore mapping or None) -> Engine.
MakeEngine = Callable[[Roles, str, "Mapping[str, Any] | None"], Engine]


class Controller:
    """Drives one job across generations (see the module docstring).

    Parameters
    ----------
    client : distributed.Client
    spec : JobSpec
    make_engine : callable
        ``make_engine(roles, job, restore)`` -> a new :class:`Engine` for one generation.
    plan_roles : callable
        ``plan_roles(alive)`` -> the roles of a new generation on the live workers.
    roles : Roles
        The first generation's roles.
    rows : int
        Training rows per epoch (for the history's epoch column).
    progress : Progress or None
    """

    def __init__(self, client: Client, spec: JobSpec, *, make_engine: MakeEngine,
                 plan_roles: PlanRoles, roles: Roles, rows: int, progress: Any = None) -> None:
        self.client, self.spec, self.make_engine = client, spec, make_engine
        self.rows = max(1, rows)
        self.log = JobLog()
        self.state = JobState()
        self.engine: Engine | None = None
        self.publisher = JobEvents(client, spec.job_id)  # the scheduler's Training page reads them
        # The current generation's roles, and where the next one's go.
        self.placement = GenerationPlacement(client, spec, plan=plan_roles, roles=roles,
                                             state=self.state, publisher=self.publisher)
        # The user's hooks run off this loop, in order: they may block and use the client.
        self.callbacks = CallbackThread(spec.callbacks, name=spec.job_id)
        # checkpoint='s store and the in-memory copies, and the pauses that write them.
        self.keeper = StateKeeper(client, spec, state=self.state, log=self.log,
                                  placement=self.placement)
        self.losses = Losses(spec=spec, log=self.log, state=self.state, publisher=self.publisher)
        self.hand_overs = HandOvers(client, spec=spec, log=self.log, state=self.state,
                                    publisher=self.publisher,
                                    checkpoints=self.keeper.checkpoints)
        # A dt.run job's reports: the checkpoint each carries, then its ranks go on.
        self.reports = Reports(client, state=self.state, log=self.log,
                               checkpoints=self.keeper.checkpoints, hand_overs=self.hand_overs)
        # The engine's events into the history, the callbacks and the stop.
        self.history = JobHistory(spec, log=self.log, state=self.state, publisher=self.publisher,
                                  callbacks=self.callbacks, reports=self.reports, rows=self.rows,
                                  progress=progress)
        # A job with room for more workers than the cluster has asks for them (see _wanted).
        self.wanted = WantedWorkers(client, spec.job_id, spec.trainer_cap)
        # A generation's end and the placing of the next, and what the next starts from.
        self.restarts = Restarts(client, state=self.state, log=self.log, keeper=self.keeper,
                                 placement=self.placement, reports=self.reports,
                                 hand_overs=self.hand_overs)
        # The cluster's changes as a generation meets them: hand-overs, and once a second lost
        # roles, joined workers and the workers the job wants.
        self.liveness = Liveness(client, state=self.state, placement=self.placement,
                                 losses=self.losses, hand_overs=self.hand_overs,
                                 wanted=self.wanted, manifest=self.keeper.manifest,
                                 has_checkpoint=self.restarts.has_checkpoint)

    @property
    def roles(self) -> Roles:
        """The current generation's roles."""
        return self.placement.roles

    def _workers(self) -> set[str]:
        """The workers of the job's roles: the current generation's, and its engine's."""
        engine = self.engine
        return set(self.roles.addresses) | set(engine.roles.addresses if engine else ())

    # -- the whole job ----------------------------------------------------------------------------
    def run_sync(self, *, resume: bool = False) -> Outcome:
        """:meth:`run` from the caller's thread (the one that called ``fit``). When the job
        raises (Ctrl-C included), the callbacks hear of it first (``on_fit_error``). Ctrl-C
        stops the roles before it is raised, and says where the job can resume (``_interrupt``)."""
        guard = RunGuard(cleaning=lambda: self.state.phase is Phase.ERRORED)
        # What the loop runs, reached through a box emptied at the end: distributed's sync()
        # keeps its callable and the error it raised in one closure, which the error's traceback
        # holds in turn (a cycle), so the callable must not hold this controller afterwards.
        box: dict[str, Any] = {"run": guard.run, "job": lambda: self.run(resume=resume)}

        def call() -> Any:
            return box["run"](box["job"])

        try:
            return self.client.sync(call)
        except KeyboardInterrupt as exc:
            error = interrupted(guard, client=self.client, job_id=self.spec.job_id,
                                workers=self._workers, log=self.log,
                                checkpoints=self.keeper.checkpoints,
                                progress=self.history.progress)
            job_failed(self.spec.callbacks, error, thread=self.callbacks, log=self.log)
            release_frames(exc)
            raise error from None
        except BaseException as exc:
            job_failed(self.spec.callbacks, exc, thread=self.callbacks, log=self.log)
            release_frames(exc)
            raise
        finally:
            box.clear()

    async def run(self, *, resume: bool = False) -> Outcome:
        """Run generation after generation until one ends; always closes the last engine."""
        for condition in self.spec.stop:  # a fit starts from fresh stop conditions
            condition.reset()
        # A role's dask-train error reaches the caller in one message (RoleFailed); the
        # workers' own "Compute Failed" records of it are left out for the job's time.
        async with quiet_job(self.client, self.spec.job_id):
            return await self._run(resume=resume)

    async def _run(self, *, resume: bool) -> Outcome:
        await self.publisher.start(self.spec, self.roles, self.rows)
        try:
            return await self._generations(resume=resume)
        finally:
            self.hand_overs.close()
            try:
                await self.wanted.close()
            except Exception:  # noqa: BLE001 - a closed client: the scheduler drops them itself
                logger.debug("job %s: its placeholder tasks were not cancelled", self.spec.job_id)
            await self.reports.drop()
            await self.keeper.close()
            await self.publisher.forget()

    async def _generations(self, *, resume: bool) -> Outcome:
        """Run the job's states (:mod:`._states`) from its first generation's start until it
        finished (its outcome is returned) or errored (its error is raised)."""
        if resume:
            self.restarts.restore = self.keeper.load_resumed()
            if self.restarts.restore is not None:
                self.history.continue_from(self.restarts.restore)
        state: State = Starting()
        while not state.terminal:
            state = await state.step(self)
        if isinstance(state, Errored):
            try:
                raise state.error
            finally:
                del state  # the error's traceback holds this frame: no cycle through the state
        assert isinstance(state, Finished)
        return state.outcome

    # -- a generation's start and its end (the controller's own steps of the states in _states) --
    async def new_engine(self) -> Engine:
        """The engine of the generation whose roles were placed last, from the state to
        restore; with the in-memory copies it needs (:meth:`StateKeeper.prepare`)."""
        restore = self.restarts.restore
        engine = self.make_engine(self.roles, f"{self.spec.job_id}-g{self.state.generation}",
                                  restore.engine_state() if restore else None)
        self.engine = engine
        self.history.keeps_scored = not isinstance(engine, Reporting)
        self.log.generations = self.state.generation + 1
        await self.keeper.prepare(engine, self.roles.addresses)
        return engine

    async def start(self, engine: Engine) -> Failure | None:
        """Start a generation; None once it runs. A role's worker lost while it starts (a
        second loss while the job restarts) is a loss like any other: the failure policy
        decides (:meth:`Losses.start_failed`), and a restart returns the failure for the next
        generation. Any other error in starting is the job's."""
        try:
            if self.state.generation:
                await self.placement.schedule_stranded()
            await engine.start(self.history.events.put_nowait)
        except Exception as exc:
            lost = await self.losses.start_failed(self.client, engine, exc,
                                                  has_checkpoint=self.restarts.has_checkpoint())
            if lost is None:
                raise
            logger.info("generation %d could not start: %s was lost", self.state.generation,
                        lost.role)
            return lost
        return None

    async def finish(self, engine: Engine) -> Ending | Failure:
        """Stop the engine, close the history with the final score, write the final checkpoint;
        a role lost while stopping that needs a new generation is returned instead."""
        self.state.enter(Phase.FINISHING)
        await self.reports.at_finish(engine, drain=self.history.next_event,
                                     manifest=self.keeper.manifest)
        ending = await self.losses.stop(self.client, engine, keep_step=self.state.stop_step,
                                        has_checkpoint=self.restarts.has_checkpoint(),
                                        notices=self.hand_overs.wait_for_notices)
        if isinstance(ending, Failure):
            # What the stop stood for (a scored snapshot) may be gone with the role.
            logger.info("the stop (%s) waits for the next generation: %s was lost",
                        self.state.withdraw_stop(), ending.role)
            return ending
        self.history.final(ending)
        await self.keeper.final(engine, ending)
        return ending
