"""Where a job's generations run: the current generation's roles, the workers seen, and the
placing of the next one.

One object per job (:class:`GenerationPlacement`). It remembers the most workers the job has
seen alive (a restart waits a little for the cluster to be back to that size: a nanny restarts
a killed worker in about a second), and which workers it has seen (one it had not is a worker
that joined: blocks whose every worker left are moved to the workers there are now). A new
generation's roles are placed by the job's placement (``plan_roles``) once enough workers are
there for it: ``dt.run``'s ``workers=(least, most)`` waits up to the job's ``timeout`` for its
least. The controller decides that a generation ends and what the next starts from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping

from distributed import Client

from dask_train.controller._publish import JobEvents
from dask_train.controller._state import JobState, Phase
from dask_train.data._stall import drop_fetches_from, schedule_stranded
from dask_train.engines._spec import JobSpec
from dask_train.errors import InvalidInput
from dask_train.policy._placement import Roles
from dask_train.policy._scaling import restart_wait
from dask_train.policy._scope import current_scope
from dask_train.runtime._calls import alive_workers, run_on_live
from dask_train.runtime._cluster_view import ClusterView

logger = logging.getLogger(__name__)

#: Places a new generation's roles on the live workers.
PlanRoles = Callable[[Mapping[str, int]], Roles]


class GenerationPlacement:
    """The roles of a job's current generation, and the placing of its next (see the module
    docstring).

    Parameters
    ----------
    client : distributed.Client
    spec : JobSpec
    plan : callable
        ``plan(alive)`` -> the roles of a generation on the live workers ``{address: threads}``;
        raises :class:`InvalidInput` when they are too few.
    roles : Roles
        The first generation's roles.
    state : JobState
    publisher : JobEvents
    """

    def __init__(self, client: Client, spec: JobSpec, *, plan: PlanRoles, roles: Roles,
                 state: JobState, publisher: JobEvents) -> None:
        self.client, self.spec, self.plan = client, spec, plan
        self.state, self.publisher = state, publisher
        self.roles = roles
        self.most_seen = len(roles.addresses)  # the most workers seen alive at once
        self.seen: set[str] = set(roles.addresses)  # a worker not in it joined
        self.listed: set[str] = set(roles.addresses)  # the last liveness pass's workers
        self.stranded_watch = False  # blocks may wait in no-worker (see schedule_stranded)

    async def saw(self, view: ClusterView) -> None:
        """A liveness pass's listing: the workers seen, stranded blocks moved when workers
        joined (or while some still wait), and the survivors' fetches from workers that left
        given up."""
        alive = view.alive()
        if self.stranded_watch or view.joined(since=self.seen):
            await self.schedule_stranded()
        left, self.listed = self.listed - set(alive), set(alive)
        if left and alive:
            # A block fetch begun from a worker as it left would wait out Dask's connect
            # timeout, and the feeds that need the block with it (see drop_fetches_from).
            dropped = await run_on_live(self.client, drop_fetches_from, sorted(left),
                                        workers=sorted(alive))
            if any(isinstance(n, int) and n for n in dropped.values()):
                logger.info("connections to %s given up on the workers that held them: %s",
                            sorted(left), {a: n for a, n in dropped.items() if n})
        self.seen |= set(alive)
        self.most_seen = max(self.most_seen, len(alive))

    async def schedule_stranded(self) -> None:
        """Blocks whose every worker left (the whole cluster replaced) would wait for a worker
        they prefer that never comes back: they go to the workers running now. Looked at again
        at each liveness check while some still wait (the workers that joined had not yet
        said they run) and whenever workers join."""
        moved, left = await self.client.run_on_scheduler(schedule_stranded, asynchronous=True)
        if moved:
            logger.info("%d data blocks whose workers all left are computed again on the "
                        "workers there are now", moved)
        self.stranded_watch = left > 0

    async def after_loss(self, *, retired: bool) -> Mapping[str, int]:
        """The live workers a restart places its next generation on: after a short wait (at
        most 10 s, :func:`~dask_train.policy._scaling.restart_wait`) for the cluster to be back
        to the most workers seen; not when every lost worker left with notice (``retired``: it
        does not come back; a sync job stopped as rank 0 retired waited the 10 s for it)."""
        alive = await alive_workers(self.client, placeable=True)
        wait = restart_wait(most_seen=self.most_seen, reserved=current_scope() is not None,
                            retired=retired, timeout=self.spec.timeout)
        deadline = time.monotonic() + wait.seconds
        if retired:
            self.most_seen = len(alive)
        while len(alive) < wait.workers and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            alive = await alive_workers(self.client, placeable=True)
        return alive

    async def after_departure(self, leaving: Collection[str]) -> Mapping[str, int]:
        """The live workers a hand-over places its next generation on: all but ``leaving``
        (a SIGTERMed worker is still listed as it closes). A retired worker does not come
        back: no restart waits for it."""
        alive = {a: n for a, n in (await alive_workers(self.client, placeable=True)).items()
                 if a not in leaving}
        self.most_seen = len(alive)
        return alive

    async def enough(self, alive: Mapping[str, int],
                     gone: Collection[str]) -> Mapping[str, int]:
        """``alive``, or, when fewer workers are left than the job's least (``dt.run``'s
        ``workers=(least, most)``), the workers once enough have joined (none of ``gone``):
        waited for up to the job's ``timeout``, said in the log; then the placement's own error
        is raised."""
        deadline = time.monotonic() + self.spec.timeout
        said = False
        while True:
            try:
                self.plan(alive)
                return alive
            except InvalidInput:
                if time.monotonic() > deadline:
                    raise
                if not said:
                    said = True
                    logger.warning("%d workers are left, fewer than the job needs: waiting up "
                                   "to %g s (timeout=) for workers to join", len(alive),
                                   self.spec.timeout)
            await asyncio.sleep(0.5)
            alive = {a: n for a, n in (await alive_workers(self.client, placeable=True)).items()
                     if a not in gone}

    def place_next(self, alive: Mapping[str, int], *, redone: int) -> None:
        """Place the next generation's roles on ``alive`` and enter its start."""
        self.roles = self.plan(alive)
        self.state.generation += 1
        # Pause ids count per generation: its roles are new and start from the first.
        self.state.pause_id, self.state.next_pause_id = 0, 1
        self.state.enter(Phase.STARTING)
        self.publisher.publish({"kind": "generation", "generation": self.state.generation,
                                "roles": dict(self.roles.placement), "redone": redone})
