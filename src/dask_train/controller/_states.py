"""The controller's states: one small object per phase, each carrying its data, whose ``step``
does that phase's work (through the objects that own each concern, or the controller's three
steps of its own: a generation's engine made, started, finished) and returns the next state.

:class:`~._controller.Controller` runs them, and only that: from :class:`Starting` until
:class:`Finished` (its :class:`Outcome` is returned) or :class:`Errored` (its error is raised).
A state's possible successors are its ``step``'s return annotation; every move still goes through
:meth:`JobState.enter <._state.JobState.enter>`, whose ``_NEXT`` table stays the one list of legal
moves (``tests/controller/test_states.py`` checks the annotations against it). The move into a
state is made as its step begins, by what does its work where that enters its phase itself
(:class:`~._restarts.Restarts`' ``after_loss`` and ``after_departure``, the controller's
``finish``); a generation's STARTING is entered as its roles are placed
(:meth:`GenerationPlacement.place_next <._generations.GenerationPlacement.place_next>`, the
restarts' last act), the first generation's is the job's first phase; a terminal state's is
entered by the step that decides it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from dask_train.controller._history import JobHistory
from dask_train.controller._hook_thread import CallbackThread
from dask_train.controller._keeping import StateKeeper
from dask_train.controller._publish import JobEvents
from dask_train.controller._reports import Reports
from dask_train.controller._restarts import Restarts
from dask_train.controller._state import JobLog, JobState, Phase
from dask_train.controller.cluster._departures import Departure
from dask_train.controller.cluster._liveness import Liveness
from dask_train.engines._protocol import Ending, Engine
from dask_train.engines._spec import JobSpec
from dask_train.policy._failure import Failure
from dask_train.policy._placement import Roles

#: How often a generation's loop looks for lost roles, joined workers and wanted workers.
_LIVENESS_EVERY_S = 1.0


@dataclass
class Outcome:
    """What ``run`` hands back: the engine's ending, the job's log, and where things ran."""

    ending: Ending
    log: JobLog
    stopped_by: str
    roles: Roles
    ledger: list[dict[str, Any]]
    epochs_completed: int
    model_step: int = -1  # the step of the parameters returned (the scored one, or the last)

    @classmethod
    def of(cls, engine: Engine, ending: Ending, *, log: JobLog, state: JobState) -> Outcome:
        """The outcome of a job that finished with ``ending`` from ``engine``'s generation:
        its parameters are the stopping score's when the engine kept them
        (``state.stop_step``), else the last ones."""
        kept = ending.final is not None and ending.final.get("params") is not None
        return cls(ending=ending, log=log, stopped_by=state.stopped_by, roles=engine.roles,
                   ledger=engine.ledger_records(), epochs_completed=engine.epochs_completed(),
                   model_step=int(state.stop_step) if kept and state.stop_step is not None
                   else ending.steps)


class Job(Protocol):
    """What the states use of the controller: its state and log, the objects that do a
    concern's work, and the controller's three steps of its own
    (:class:`~._controller.Controller` is the one implementation)."""

    state: JobState
    log: JobLog
    spec: JobSpec
    callbacks: CallbackThread
    publisher: JobEvents
    # Running: the engine's events and the stop; a checkpoint's pause; a dt.run report; the
    # cluster's changes
    history: JobHistory
    keeper: StateKeeper
    reports: Reports
    liveness: Liveness
    # Restarting, HandingOver: the generation ended, the next one's roles placed
    restarts: Restarts

    # The controller's own: a generation's engine made and started (Starting), its end
    # (Finishing)
    async def new_engine(self) -> Engine: ...
    async def start(self, engine: Engine) -> Failure | None: ...
    async def finish(self, engine: Engine) -> Ending | Failure: ...


class State:
    """A state of the job: ``phases`` are those the job is in during its step (the first one the
    phase a move into it enters); a terminal state has no step."""

    phases: ClassVar[tuple[Phase, ...]]
    terminal: ClassVar[bool] = False

    async def step(self, job: Job) -> State:
        """Do this state's work; the state the job moves to."""
        raise NotImplementedError


@dataclass
class Starting(State):
    """A generation's engine is made, from the roles and the state to restore the controller
    holds, and started. Its roles were placed before: the job's first, or a restart's."""

    phases: ClassVar[tuple[Phase, ...]] = (Phase.STARTING,)

    async def step(self, job: Job) -> Running | Restarting | Errored:
        # Made outside the guard below, as it always was: an error here is raised as it is.
        engine = await job.new_engine()
        try:
            failure = await job.start(engine)
        except BaseException as exc:
            return await errored(job, exc, engine)
        if failure is not None:  # a role's worker lost while it started: the policy restarts
            return Restarting(engine, failure)
        job.log.roles_up_at = job.log.roles_up_at or time.time()
        return Running(engine)


@dataclass
class Running(State):
    """One generation's loop: pass after pass until a stop is decided (then
    :class:`Finishing`), a role is lost (:class:`Restarting`), or the job is handed over or
    regrouped (:class:`HandingOver`). A checkpoint's pause is a part of it (CHECKPOINTING)."""

    engine: Engine
    next_liveness: float = field(default=0.0)  # when the next pass looks at the roles

    phases: ClassVar[tuple[Phase, ...]] = (Phase.RUNNING, Phase.CHECKPOINTING)

    async def step(self, job: Job) -> Finishing | Restarting | HandingOver | Errored:
        try:
            job.state.enter(Phase.RUNNING)
            while not job.state.stopped_by:
                ended = await self.one_pass(job)
                if isinstance(ended, Failure):
                    return Restarting(self.engine, ended)
                if ended is not None:
                    return HandingOver(self.engine, ended)
        except BaseException as exc:
            return await errored(job, exc, self.engine)
        return Finishing(self.engine)

    async def one_pass(self, job: Job) -> Failure | Departure | None:
        """One pass over the generation's concerns, in order; the failure or departure that
        ends the generation, if one does."""
        engine = self.engine
        await job.history.take_event()
        job.history.callback_stop()
        now = time.time()
        if not job.state.stopped_by:
            job.history.check_time(now)
            if await engine.tick(now):  # its trainers ended on their own
                job.history.trainers_ended(engine)
            await job.keeper.step(engine, now)
            keeper = job.keeper
            departure = await job.reports.step(engine, manifest=keeper.manifest,
                                               copies=keeper.copies, copied=keeper.mark_copied)
            if departure is not None:
                return departure
        if job.state.phase is Phase.RUNNING and not job.state.stopped_by:
            departure = await job.liveness.hand_over(engine)
            if departure is not None:
                return departure
        if now >= self.next_liveness:
            self.next_liveness = now + _LIVENESS_EVERY_S
            return await job.liveness.check(engine)
        return None


@dataclass
class Restarting(State):
    """A lost role: this generation ends, the next one's roles are placed
    (:meth:`Restarts.after_loss <._restarts.Restarts.after_loss>`)."""

    engine: Engine
    failure: Failure

    phases: ClassVar[tuple[Phase, ...]] = (Phase.RESTARTING,)

    async def step(self, job: Job) -> Starting | Errored:
        try:
            await job.restarts.after_loss(self.engine, self.failure)
        except BaseException as exc:
            return await errored(job, exc, self.engine)
        return Starting()


@dataclass
class HandingOver(State):
    """A worker left with notice, or joined: this generation ends, the next one's roles are
    placed from the state just handed over
    (:meth:`Restarts.after_departure <._restarts.Restarts.after_departure>`)."""

    engine: Engine
    departure: Departure

    phases: ClassVar[tuple[Phase, ...]] = (Phase.RESTARTING,)

    async def step(self, job: Job) -> Starting | Errored:
        try:
            await job.restarts.after_departure(self.engine, self.departure)
        except BaseException as exc:
            return await errored(job, exc, self.engine)
        return Starting()


@dataclass
class Finishing(State):
    """A stop was decided: the roles stop, the final score and checkpoint (``finish``); then
    the engine closes and the callbacks finish."""

    engine: Engine

    phases: ClassVar[tuple[Phase, ...]] = (Phase.FINISHING,)

    async def step(self, job: Job) -> Finished | Restarting | Errored:
        engine = self.engine
        try:
            finished = await job.finish(engine)
        except BaseException as exc:
            return await errored(job, exc, engine)
        if isinstance(finished, Failure):
            return Restarting(engine, finished)
        # Outside the guard, as they always were: the job's own end.
        await engine.close()
        await job.callbacks.finish(job.spec.timeout)  # on_fit_end comes after every hook
        error = job.history.untrained(finished)
        if error is not None:
            # Nothing was trained: parameters as they started are no result. Raised once the
            # engine is closed, so the job leaves nothing behind; callbacks hear on_fit_error.
            return await errored(job, error, None)
        job.state.enter(Phase.FINISHED)
        await job.publisher.end(stopped_by=job.state.stopped_by)
        return Finished(Outcome.of(engine, finished, log=job.log, state=job.state))


@dataclass
class Finished(State):
    """The job ended: its outcome."""

    outcome: Outcome

    phases: ClassVar[tuple[Phase, ...]] = (Phase.FINISHED,)
    terminal: ClassVar[bool] = True


@dataclass
class Errored(State):
    """The job raised: its error, raised by the controller once the job's end is published and
    its callbacks and engine are closed (:func:`errored`)."""

    error: BaseException

    phases: ClassVar[tuple[Phase, ...]] = (Phase.ERRORED,)
    terminal: ClassVar[bool] = True


async def errored(job: Job, error: BaseException, engine: Engine | None) -> Errored:
    """The move to :class:`Errored`: ERRORED entered, the job's "end" published with its error,
    and, with ``engine`` (None: the job's end closed them already), the callbacks and the
    engine closed. Awaited in the handler of ``error``, so that an error closing the engine
    chains to it."""
    job.state.enter(Phase.ERRORED)
    job.publisher.publish({"kind": "end", "error": "interrupted (Ctrl-C)" if
                           isinstance(error, asyncio.CancelledError) else
                           f"{type(error).__name__}: {error}"})
    if engine is not None:
        job.callbacks.close()
        await engine.close()
    return Errored(error)
