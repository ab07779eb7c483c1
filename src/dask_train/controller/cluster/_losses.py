"""What the controller does about lost roles, at any moment of a generation.

Each lost or failed role goes to the pure failure policy (:func:`~dask_train.policy._failure.decide`)
with the job's count of losses, where a lost worker counts once whatever roles it held (a trainer
and the scorer). The actions that let the survivors go on (a replaced scorer, a retired async
trainer) are taken here; a restart is returned to the controller, which starts the next
generation. The same rules hold while a generation runs, while it starts and while it stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence

from distributed import Client

from dask_train.controller._publish import JobEvents
from dask_train.controller._state import JobLog, JobState
from dask_train.engines._protocol import Elastic, Ending, Engine, Reporting, Survivable
from dask_train.engines._spec import JobSpec
from dask_train.errors import WorkerLost
from dask_train.policy._failure import Action, Failure, JobStatus, decide, failure_error
from dask_train.policy._scope import current_scope
from dask_train.runtime._calls import alive_workers, asked_to_retire
from dask_train.runtime._cluster_view import ClusterView, look

logger = logging.getLogger(__name__)

#: How long a generation whose start failed as a worker was lost waits for the scheduler to
#: remove that worker (it does within a second of a kill; a loaded machine takes longer).
LOSS_SEEN_S = 10.0


class Losses:
    """The decisions on one job's lost roles, recorded in its log and published.

    Parameters
    ----------
    spec : JobSpec
    log : JobLog
        Receives one record per lost role (``result.failures``).
    state : JobState
    publisher : JobEvents

    Every decision takes ``has_checkpoint``: whether the job has a checkpoint to restart from
    (written, or resumed from), which only the controller knows.
    """

    def __init__(self, *, spec: JobSpec, log: JobLog, state: JobState,
                 publisher: JobEvents) -> None:
        self.spec, self.log, self.state, self.publisher = spec, log, state, publisher

    def decide(self, engine: Engine, failure: Failure, alive: Mapping[str, int], *,
               has_checkpoint: bool, same_loss: bool = False,
               notice: bool | None = None) -> Action:
        """The policy's action on one lost role (raises the typed error on RAISE);
        ``same_loss``: its worker's loss was counted with another of its roles.

        A worker that left with notice and was not handed over (it left while the job
        started or stopped, when no hand-over is made) is acted on as a loss, from the same
        state, but recorded with ``notice`` and not counted against ``max_failures``: it is
        no crash, and a cluster of ``--lifetime`` workers would otherwise fail a long job.
        ``notice``: the caller knows (default: the worker announced it to this generation).
        """
        live = engine.live_trainers() - (1 if failure.kind == "trainer" else 0)
        if notice is None:
            notice = failure.worker in engine.leaving()
        losses = {f["loss"] for f in self.log.failures if f["loss"] is not None}
        loss = len(losses) + (0 if same_loss or notice else 1)
        status = JobStatus(
            strategy=engine.strategy, failure=failure, failures=loss,
            live_trainers=max(0, live), live_workers=len(alive),
            has_checkpoint=has_checkpoint,
            survivors_hold_state=isinstance(engine, Survivable), notice=notice,
            independent_trainers=isinstance(engine, Elastic),
            reports_state=isinstance(engine, Reporting))
        decision = decide(status, self.spec.failure)
        self.log.failures.append({
            "time_s": self.log.elapsed(), "role": failure.role, "worker": failure.worker,
            "cause": failure.cause, "action": decision.action.value, "reason": decision.reason,
            "generation": self.state.generation, "loss": None if notice else loss,
            "notice": notice,
        })
        self.publisher.publish({"kind": "failure", **self.log.failures[-1]})
        logger.warning("%s on %s: %s -> %s (%s)", failure.role, failure.worker, failure.cause,
                       decision.action.value, decision.reason)
        if decision.action is Action.RAISE:
            raise failure_error(status, decision)
        return decision.action

    async def workers_back(self, client: Client, alive: Mapping[str, int]) -> dict[str, int]:
        """``alive``, or, when no worker is left, the workers that joined within the job's
        ``timeout`` (none: the loss is then decided with none, and the job fails).

        Why: a cluster whose every worker goes at once (Slurm jobs started together reaching
        their walltime, a node pool replaced) usually gets new workers seconds later; a job
        that failed at once would lose what its checkpoint or its copies hold. A job on
        reserved workers (a search's trial) does not wait: no worker joins its scope.
        """
        found = dict(alive)
        if found or current_scope() is not None:
            return found
        logger.warning("no worker is left: waiting up to %g s (timeout=) for workers to join "
                       "before the job fails", self.spec.timeout)
        deadline = time.monotonic() + self.spec.timeout
        while not found and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            found = await alive_workers(client, placeable=True)
        return found

    @staticmethod
    async def noticed(client: Client, engine: Engine, workers: Iterable[str]) -> set[str]:
        """Those of the lost ``workers`` that left with notice: announced to this generation,
        or retired before any role of it ran there (placed as its lifetime ended: it held
        nothing and told no job), as the scheduler's own events of it say."""
        workers = set(workers)
        announced = workers & engine.leaving()
        return announced | await asked_to_retire(client, workers - announced)

    async def act(self, engine: Engine, failures: Sequence[Failure], alive: Mapping[str, int],
                  *, has_checkpoint: bool, noticed: Collection[str] = ()) -> Failure | None:
        """Decide on each failure in turn and act: the scorer replaced, an async trainer
        retired. Returns the first failure that needs a new generation (None: the survivors
        go on). Every failure of the pass is decided and recorded, also those after one that
        restarts: two hosts lost together are two records in ``result.failures``, and two
        losses against ``max_failures``. ``noticed``: workers that left with notice without
        announcing it to the job (see :meth:`noticed`)."""
        restart: Failure | None = None
        for i, failure in enumerate(failures):
            # A worker that held several roles (a trainer and the scorer) is one loss.
            again = any(f.worker == failure.worker for f in failures[:i])
            action = self.decide(engine, failure, alive, has_checkpoint=has_checkpoint,
                                 same_loss=again,
                                 notice=True if failure.worker in noticed else None)
            if restart is not None:
                continue  # the new generation starts on the live workers only
            if action is Action.RESTART:
                restart = failure
            elif action is Action.REPLACE:
                await engine.replace_scorer(alive)
            elif isinstance(engine, Elastic):
                await engine.retire_trainer(failure.index)
            else:  # the policy goes on without a trainer only where trainers are independent
                raise NotImplementedError(f"{type(engine).__name__} cannot continue without a "
                                          "trainer")
        return restart

    @staticmethod
    async def failures(client: Client, engine: Engine,
                       view: ClusterView) -> tuple[list[Failure], dict[str, int]]:
        """The engine's lost or failed roles over ``view``, and the live workers they are
        judged against: ``view``'s, or a fresh look's when a failure names a worker ``view``
        still lists. The engine may have looked again (waiting for a peer's death to show) and
        found that worker gone: on the older view a retiring one counted against
        ``max_failures`` as a crash, and a loss as the job stopped was taken for the job's own
        error."""
        alive = view.alive()
        failures = await engine.failures(view)
        if any(f.worker in alive for f in failures):
            alive = (await look(client)).alive()
        return failures, alive

    async def lost(self, client: Client, engine: Engine) -> tuple[list[Failure], dict[str, int]]:
        """The roles whose worker has left the cluster, and the live workers (waited for a
        while when none is left, see :meth:`workers_back`)."""
        failures, alive = await self.failures(client, engine, await look(client))
        lost = [f for f in failures if f.worker not in alive]
        if lost:
            alive = await self.workers_back(client, alive)
        return lost, alive

    async def lost_in_start(self, client: Client, engine: Engine,
                            error: BaseException) -> tuple[list[Failure], dict[str, int]]:
        """:meth:`lost`, after a generation's start raised ``error``. When the error is a lost
        worker's (a ``WorkerLost``, a closed connection) the scheduler may not have removed
        that worker yet (a kill as the ranks were placed: their probe's connection closed
        first): asked again for up to :data:`LOSS_SEEN_S` seconds. Not after a timeout (an
        ``OSError`` too): the scheduler had the whole timeout to see a loss."""
        lost, alive = await self.lost(client, engine)
        deadline = time.monotonic() + LOSS_SEEN_S
        worker_lost = isinstance(error, (WorkerLost, OSError)) and \
            not isinstance(error, TimeoutError)
        while not lost and worker_lost and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            lost, alive = await self.lost(client, engine)
        return lost, alive

    async def start_failed(self, client: Client, engine: Engine, error: BaseException, *,
                           has_checkpoint: bool) -> Failure | None:
        """A generation's start raised ``error``: the lost role that restarts the job, decided
        as any loss, or None when no role was lost or the policy does not restart (the
        caller then raises ``error``; a RAISE decision raises its own typed error here).

        A worker retired as the generation started (its lifetime ended just after it was
        placed) held no role's state yet, so it announced itself to no job; the scheduler's
        events of it say it left with notice (:meth:`noticed`)."""
        lost, alive = await self.lost_in_start(client, engine, error)
        if not lost:
            return None
        noticed = bool(await self.noticed(client, engine, [lost[0].worker]))
        if self.decide(engine, lost[0], alive, notice=noticed,
                       has_checkpoint=has_checkpoint) is not Action.RESTART:
            return None
        return lost[0]

    async def stop(self, client: Client, engine: Engine, *, keep_step: int | None,
                   has_checkpoint: bool,
                   notices: Callable[[Engine, set[str]], Awaitable[None]] | None = None
                   ) -> Ending | Failure:
        """Stop the engine's roles. A role lost meanwhile (the scorer's worker killed as a
        score stops the job) is a loss like any other: the job stops without a lost async
        trainer, or with the scorer started again (the final parameters then make the
        result), or the failure that needs a new generation is returned (a server, a rank).
        An error with every role's worker alive is the job's.

        A parameter server whose worker leaves with notice as the job stops is no loss: its
        worker is held while the job has state on it, and the engine pulls its final
        parameters directly. ``notices(engine, workers)`` waits (briefly) for the notices of
        lost ``workers`` that still answer (a retired worker is gone from the scheduler a few
        milliseconds before its notice comes)."""
        pulled: set[str] = set()  # held servers' workers: pulled directly, once each
        while True:
            try:
                return await engine.stop(keep_step=keep_step)
            except Exception:
                lost, alive = await self.lost(client, engine)
                if notices is not None and {f.worker for f in lost} - engine.leaving():
                    await notices(engine, {f.worker for f in lost})
                held = {f.worker for f in lost if f.kind == "ps" and
                        f.worker in engine.leaving() - pulled}
                pulled |= held
                lost = [f for f in lost if f.worker not in held or f.kind != "ps"]
                if not lost and held:
                    continue  # the next stop pulls from them directly
                if not lost:
                    raise
                restart = await self.act(engine, lost, alive, has_checkpoint=has_checkpoint)
                if restart is not None:
                    return restart
