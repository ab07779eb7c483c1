"""A generation's look at the cluster, on the client: in each pass, the hand-over of a worker
that gave notice; once a second, the liveness pass over one
:class:`~dask_train.runtime._cluster_view.ClusterView`: the lost or failed roles (decided on by
:mod:`._losses`), the async trainers' adoption of workers that joined, the regroup of a job that
grows only in a new generation onto them, and the workers the job wants (:mod:`._wanted`).

One object per job (:class:`Liveness`), which the ``Running`` state calls; what it finds that
ends the generation (a failure to restart from, a departure or arrival to hand over) it returns
for the states to move on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from distributed import Client

from dask_train.controller._generations import GenerationPlacement
from dask_train.controller._state import JobState, Phase
from dask_train.controller.cluster._departures import Departure, HandOvers, Manifest
from dask_train.controller.cluster._losses import Losses
from dask_train.controller.cluster._wanted import WantedWorkers
from dask_train.engines._protocol import Elastic, Engine, Regrouping
from dask_train.policy._failure import Failure
from dask_train.policy._scaling import may_regroup, regroup_wanted
from dask_train.runtime._calls import alive_workers
from dask_train.runtime._cluster_view import ClusterView, look

logger = logging.getLogger(__name__)


class Liveness:
    """The cluster's changes as one job's generation meets them (see the module docstring).

    Parameters
    ----------
    client : distributed.Client
    state : JobState
        A stop decided in the pass that lost a role is withdrawn there.
    placement : GenerationPlacement
        The workers seen, and the placement a regroup would make.
    losses : Losses
    hand_overs : HandOvers
    wanted : WantedWorkers
    manifest : callable
        The job's ``manifest(ledger, rng)`` for a snapshot a hand-over writes
        (:meth:`StateKeeper.manifest <dask_train.controller._keeping.StateKeeper.manifest>`).
    has_checkpoint : callable
        Whether the job has a checkpoint to restart from
        (:meth:`Restarts.has_checkpoint <dask_train.controller._restarts.Restarts.has_checkpoint>`).
    """

    def __init__(self, client: Client, *, state: JobState, placement: GenerationPlacement,
                 losses: Losses, hand_overs: HandOvers, wanted: WantedWorkers,
                 manifest: Manifest, has_checkpoint: Callable[[], bool]) -> None:
        self.client, self.state, self.placement = client, state, placement
        self.losses, self.hand_overs, self.wanted = losses, hand_overs, wanted
        self.manifest, self.has_checkpoint = manifest, has_checkpoint

    async def hand_over(self, engine: Engine) -> Departure | None:
        """Hand the job over from a worker that gave notice; the departure that ends the
        generation, if the hand-over took its state."""
        if self.hand_overs.pending(engine):
            departure = await self.hand_overs.hand_over(
                engine, await alive_workers(self.client), manifest=self.manifest)
            if departure is not None:
                return departure
        await self.hand_overs.overdue(engine)
        return None

    async def check(self, engine: Engine) -> Failure | Departure | None:
        """Look at the roles, the workers that joined and the workers the job wants: the
        failure that needs a new generation, or the regroup onto joined workers, if any."""
        view = await look(self.client)  # the one listing this pass reads
        failure = await self._check_roles(engine, view)
        if failure is not None:
            withdrawn = self.state.withdraw_stop()
            if withdrawn:
                # Decided in this same pass: the parameters it stands for (a scored
                # snapshot, the last epoch) may be gone with the lost role.
                logger.info("the stop (%s) waits for the next generation: %s was lost "
                            "in the same moment", withdrawn, failure.role)
            return failure
        arrival = await self._take_arrivals(engine, view)
        if arrival is not None:
            return arrival
        if self.wanted.most is not None or self.wanted.waiting:
            await self.wanted.update(engine.live_trainers(),
                                     running=not self.state.stopped_by)
        return None

    async def _check_roles(self, engine: Engine, view: ClusterView) -> Failure | None:
        """Act on lost or failed roles (the workers as ``view`` lists them); the failure that
        needs a new generation, if any."""
        await self.placement.saw(view)
        failures, alive = await self.losses.failures(self.client, engine, view)
        gone = {f.worker for f in failures if f.worker not in alive}
        if gone - engine.leaving():
            await self.hand_overs.wait_for_notices(engine, gone)
        # A worker leaving with notice is handed over (see hand_over), not lost; once its
        # hand-over was tried and failed (the engine forgets it), its loss is decided as any other.
        leaving = engine.leaving()
        failures = [f for f in failures if f.worker not in leaving]
        noticed: set[str] = set()
        if failures:
            # A worker retired before its role ran held nothing to hand over: no hand-over,
            # but a loss with notice.
            noticed = await self.losses.noticed(self.client, engine, gone)
            alive = await self.losses.workers_back(self.client, alive)
        restart = await self.losses.act(engine, failures, alive,
                                        has_checkpoint=self.has_checkpoint(), noticed=noticed)
        # Not during a checkpoint's pause: a trainer started now never got the pause request,
        # and the pause would wait for it until the timeout (seen in the chaos test, a
        # restarted worker adopted while the other trainer was paused); the next pass adopts.
        if not failures and not self.state.stopped_by and self.state.phase is Phase.RUNNING:
            # Not a worker on its way out (retiring, closing after a SIGTERM): the scheduler
            # lists it for a moment, and a role placed there would leave with it.
            if isinstance(engine, Elastic):  # others grow by a regroup (_take_arrivals)
                await engine.adopt_workers(view.placeable())
        return restart

    async def _take_arrivals(self, engine: Engine, view: ClusterView) -> Departure | None:
        """Regroup a job whose engine grows only in a new generation (sync ranks, ``dt.run``)
        onto workers that joined (as ``view`` lists them), when its placement would give them
        ranks."""
        if not may_regroup(grows_by_regroup=isinstance(engine, Regrouping),
                           running=self.state.phase is Phase.RUNNING and engine.running(),
                           stopping=bool(self.state.stopped_by),
                           handing_over=self.hand_overs.awaiting is not None,
                           leaving=bool(engine.leaving())):
            return None
        alive = view.placeable()
        if not view.joined(since=engine.roles.addresses) & set(alive):
            return None
        try:
            roles = self.placement.plan(alive)
        except Exception:  # noqa: BLE001 - no placement now: nothing to grow into
            return None
        if not regroup_wanted(current_trainers=len(engine.roles["trainer"]),
                              planned_trainers=len(roles["trainer"])):
            return None
        joined = set(roles.addresses) - set(engine.roles.addresses)
        return await self.hand_overs.hand_over(engine, alive, manifest=self.manifest,
                                               joined=joined)
