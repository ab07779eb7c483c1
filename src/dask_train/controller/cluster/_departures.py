"""What the controller does when a worker leaves with notice: hand its roles over, lose nothing.

Most changes of a real cluster come with notice: ``client.retire_workers``, ``cluster.scale``
down and adaptive clusters, ``dask worker --lifetime``. Dask removes such a worker from the
scheduler and then closes it; dask-train's worker plugin holds the closing worker (bounded, see
:func:`~dask_train.runtime._plugin.hold_for_hand_over`) and tells the job (a
:class:`~dask_train.engines._events.Leaving` event). While it is held, the controller:

1. pauses every trainer at its next consistent point, as for a checkpoint (the leaving worker is
   reached directly, the scheduler no longer knows it);
2. writes that state, the leaving holders' shards included, to the job's checkpoint store, or,
   for a job without ``checkpoint=`` whose workers all run on this machine, to a scratch
   directory removed at the job's end;
3. ends the generation (the leaving worker's roles stop and its hold ends) and starts the next
   one on the live workers from that state: nothing is trained again, and the departure is
   recorded in ``result.departures``, not counted against ``max_failures``.

A killed worker gives no notice, but where the surviving trainers hold the state to go on
from (sync ranks), :meth:`HandOvers.from_survivors` writes it the same way before the next
generation starts.

A hand-over that cannot be completed (the leaving worker killed in the middle of it, no store
to write to, a pause that does not come) is a loss like a crash: the failure policy decides on
it at the next look at the roles.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from distributed import Client

from dask_train.controller._checkpointing import Checkpoints, Restore
from dask_train.controller._publish import JobEvents
from dask_train.controller._state import JobLog, JobState, Phase
from dask_train.controller.cluster._memory import (
    HAND_OVER,
    drop_store,
    memory_place_of,
    memory_store,
    on_this_machine,
    rehold,
)
from dask_train.engines._protocol import Engine, Reporting, Snapshot, Survivable
from dask_train.engines._spec import JobSpec
from dask_train.errors import WorkerLost
from dask_train.policy._copies import MemoryPlace
from dask_train.policy._placement import KINDS
from dask_train.runtime._calls import alive_workers, listens

logger = logging.getLogger(__name__)

#: The longest wait for every trainer to pause for a hand-over: well inside the 60 s a
#: leaving worker is held by default.
PAUSE_S = 30.0

#: How often a hand-over looks whether the held workers still answer (seconds).
LOOK_S = 0.25

#: How long a hand-over goes on with no other worker left (every worker leaving at once, to
#: a store that outlives them): the pause or report comes within it when the workers only
#: cycle (``--lifetime-restart``); an in-process cluster closing under a job never pauses.
ALONE_S = 5.0

#: How long a lost worker's loss waits for its leaving notice: Dask removes a retired worker
#: from the scheduler a few milliseconds before the worker (closing) sends the notice.
NOTICE_S = 0.5

#: The controller's manifest of a snapshot: ``manifest(ledger, rng)``.
Manifest = Callable[[dict[str, Any], Mapping[str, str]], dict[str, Any]]


@dataclass(frozen=True)
class Departure:
    """Workers that left with notice (``workers``), or joined (``joined``), and the state the
    job regroups from."""

    workers: tuple[str, ...]
    roles: tuple[str, ...]
    restore: Restore
    noticed_at: float  # time.monotonic() when the notice was acted on
    joined: tuple[str, ...] = ()


@dataclass
class _Awaited:
    """A ``dt.run`` regroup waiting for its ranks' next report with a checkpoint."""

    leaving: set[str]
    joined: set[str]
    noticed: float
    deadline: float


def _what(leaving: set[str], joined: set[str]) -> str:
    parts = ([f"{', '.join(sorted(leaving))} is leaving"] if leaving else []) + \
        ([f"{', '.join(sorted(joined))} joined"] if joined else [])
    return " and ".join(parts)


class HandOvers:
    """The hand-overs of one job's leaving workers.

    Parameters
    ----------
    client : distributed.Client
    spec : JobSpec
    log : JobLog
        Receives one record per departure (``result.departures``).
    state : JobState
    publisher : JobEvents
    checkpoints : Checkpoints or None
        The job's own store; None when it has no ``checkpoint=``.

    The regroups take ``manifest``, the controller's ``manifest(ledger, rng)`` for a snapshot,
    per call: held here, the controller's bound method would make a cycle that keeps the
    generation's blocks alive until the next garbage collection.
    """

    def __init__(self, client: Client, *, spec: JobSpec, log: JobLog, state: JobState,
                 publisher: JobEvents, checkpoints: Checkpoints | None) -> None:
        self.client = client
        self.spec, self.log, self.state, self.publisher = spec, log, state, publisher
        self.checkpoints = checkpoints
        self.started: set[str] = set()  # notices acted on, handed over or not
        # A dt.run job's regroup waits for its ranks' next report with a checkpoint.
        self.awaiting: _Awaited | None = None
        self._scratch: Checkpoints | None = None
        self._said_no_store = False
        self._alone_since: float | None = None  # when no other worker was left (_still_there)

    def pending(self, engine: Engine) -> set[str]:
        """Leaving workers of this generation's roles whose hand-over has not started."""
        return engine.leaving() - self.started

    async def wait_for_notices(self, engine: Engine, workers: set[str]) -> None:
        """Give lost ``workers`` that still listen (held, not killed) a moment
        (:data:`NOTICE_S`) to say they are leaving. A killed worker's port refuses at once: its
        loss is not delayed (meanwhile the survivors of a lost server would go on consuming)."""
        looked = sorted(workers)
        answers = await asyncio.gather(*(listens(w) for w in looked))  # a dead host's: 2 s
        listening = {w for w, up in zip(looked, answers) if up}
        deadline = time.monotonic() + NOTICE_S
        while listening - engine.leaving() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def _store(self, engine: Engine, alive: Iterable[str] | None = None
                     ) -> Checkpoints | None:
        """Where the hand-over's state goes: the job's store, else one in memory
        (:func:`memory_store`), its holders among the live workers that stay (``alive``, by
        default the scheduler's). None: no such worker."""
        if self.checkpoints is not None:
            return self.checkpoints
        if alive is None:
            alive = await alive_workers(self.client)
        alive = [a for a in alive if a not in engine.leaving()]
        workers = [*engine.roles.addresses, *alive]
        if not alive and not on_this_machine(workers):
            return None
        if self._scratch is None:
            self._scratch = memory_store(HAND_OVER, self.spec.job_id, workers=workers,
                                         alive=alive, timeout=self.spec.timeout,
                                         memory_state=self.spec.memory_state, keep=1)
        else:
            self._scratch = rehold(self._scratch, alive=alive, workers=engine.roles.addresses)
        return self._scratch

    def _fail(self, engine: Engine, leaving: set[str], why: str) -> None:
        """The hand-over cannot be done: the leaving workers become losses."""
        logger.warning("the hand-over from %s failed (%s): handled as a lost worker",
                       ", ".join(sorted(leaving)), why)
        engine.left(leaving)

    async def hand_over(self, engine: Engine, alive: Iterable[str], *, manifest: Manifest,
                        joined: Iterable[str] = ()) -> Departure | None:
        """Regroup the job: hand the pending leaving workers' roles over, or take in workers
        that ``joined``. An engine that pauses on request is paused now, its state written, and
        the departure returned; a ``dt.run`` job's is taken at its ranks' next report with a
        checkpoint (:meth:`at_report`). None: not (yet) regrouped; a failed hand-over is a
        loss at the next look at the roles."""
        leaving, joined = self.pending(engine), set(joined)
        self.started |= leaving
        noticed = time.monotonic()
        self._alone_since = None
        store = await self._store(engine, alive)
        if store is None:
            if leaving:
                self._fail(engine, leaving, "this job has no checkpoint= to hand them over "
                           "through, and no other live worker to keep its state in memory; set "
                           "checkpoint= to a path every worker reaches to hand over without loss")
            elif not self._said_no_store:
                self._said_no_store = True
                logger.info("%s joined: this job uses it at its next generation (it has no "
                            "checkpoint= to regroup through now)", ", ".join(sorted(joined)))
            return None
        if isinstance(engine, Reporting):
            # Its ranks pause only at their reports: the next one that carries a checkpoint.
            if self.awaiting is None:
                self.awaiting = _Awaited(set(), set(), noticed, noticed + PAUSE_S)
            self.awaiting.leaving |= leaving
            self.awaiting.joined |= joined
            logger.info("%s: the job regroups at its next report with a checkpoint (within "
                        "%g s)", _what(leaving, joined), PAUSE_S)
            return None
        state = self.state
        state.enter(Phase.CHECKPOINTING)
        state.pause_id, state.next_pause_id = state.next_pause_id, state.next_pause_id + 1
        state.pause_started = time.time()
        try:
            await engine.pause(state.pause_id)
            deadline = time.monotonic() + min(PAUSE_S, self.spec.timeout)
            next_look = time.monotonic() + LOOK_S
            while (snapshot := engine.paused(state.pause_id)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the trainers did not all pause within "
                                       f"{min(PAUSE_S, self.spec.timeout):g} s")
                if time.monotonic() > next_look:
                    # A held worker killed meanwhile never pauses: found in a look, not a timeout.
                    await self._still_there(engine, leaving)
                    next_look = time.monotonic() + LOOK_S
                await asyncio.sleep(0.01)
            step = await engine.exact_step()
            if step < 0:
                raise WorkerLost("the first parameter holder's worker left before its step "
                                 "was read")
            departure = await self._write(engine, store, leaving, joined, snapshot,
                                          manifest=manifest, noticed=noticed, step=step)
        except Exception as exc:  # noqa: BLE001 - any failure makes it a loss, said once
            if leaving:
                self._fail(engine, leaving, f"{type(exc).__name__}: {exc}")
            else:  # an arrival that could not be taken in now: used at the next generation
                logger.info("%s joined, but the job could not regroup now (%s: %s)",
                            ", ".join(sorted(joined)), type(exc).__name__, exc)
            await engine.resume(state.pause_id)
            state.pause_id = 0
            state.enter(Phase.RUNNING)
            return None
        return departure

    async def overdue(self, engine: Engine) -> None:
        """A ``dt.run`` regroup whose report did not come in time (or whose held worker is
        gone) is given up: its leaving workers become losses."""
        waiting = self.awaiting
        if waiting is None:
            return
        try:
            if time.monotonic() > waiting.deadline:
                raise TimeoutError(f"no report with a checkpoint within {PAUSE_S:g} s")
            await self._still_there(engine, waiting.leaving)
        except Exception as exc:  # noqa: BLE001 - any failure makes it a loss, said once
            self.awaiting = None
            if waiting.leaving:
                self._fail(engine, waiting.leaving, f"{type(exc).__name__}: {exc}")

    async def at_report(self, engine: Engine, report_id: int, *,
                        manifest: Manifest) -> Departure | None:
        """Every rank reported ``report_id`` with a checkpoint, the leaving ones too: write it
        where the next generation starts from (the ranks wait at their report meanwhile)."""
        waiting, self.awaiting = self.awaiting, None
        if waiting is None:
            return None
        snapshot = engine.paused(report_id)
        store = await self._store(engine)
        try:
            if snapshot is None or store is None:
                raise ValueError("the report holds no state")
            return await self._write(engine, store, waiting.leaving, waiting.joined, snapshot,
                                     manifest=manifest, noticed=waiting.noticed,
                                     step=snapshot.step)
        except Exception as exc:  # noqa: BLE001 - any failure makes it a loss, said once
            if waiting.leaving:
                self._fail(engine, waiting.leaving, f"{type(exc).__name__}: {exc}")
            return None

    async def _write(self, engine: Engine, store: Checkpoints, leaving: set[str],
                     joined: set[str], snapshot: Snapshot, *, manifest: Manifest,
                     noticed: float, step: int) -> Departure:
        """Write the paused state to ``store`` and read it back as the next start."""
        state = self.state
        info = await store.write(engine, state, manifest(snapshot.ledger, snapshot.rng),
                                 step=step, generation=state.generation,
                                 pause_s=time.time() - state.pause_started)
        if info is None:
            raise ValueError("the parameters are not finite")
        restore = store.load(n_params=self.spec.n_params, strategy=self.spec.strategy)
        if restore is None:
            raise FileNotFoundError(f"the hand-over's checkpoint {info['directory']} "
                                    "cannot be read back")
        if store is self.checkpoints:
            self.log.checkpoints.append({**info, "hand_over": True})
        roles = tuple(f"{kind}-{i}" for kind in KINDS
                      for i, a in enumerate(engine.roles.get(kind, [])) if a in leaving)
        return Departure(workers=tuple(sorted(leaving)), roles=roles, restore=restore,
                         noticed_at=noticed, joined=tuple(sorted(joined)))

    async def from_survivors(self, engine: Engine, lost: set[str], *,
                             manifest: Manifest) -> Restore | None:
        """After ``lost`` workers were killed, the state the surviving trainers hold
        (:meth:`Engine.survivors`), written where a hand-over's goes, to start the next
        generation from: a killed sync rank costs its unfinished step, not the work since the
        last stored checkpoint. None: no survivor holds one, or there is no store to write it
        to (the job restarts from its stored checkpoint)."""
        if not isinstance(engine, Survivable):
            return None
        t0 = time.monotonic()
        try:
            snapshot = await engine.survivors(lost)
            stored = None if self.checkpoints is None else self.checkpoints.load(
                n_params=self.spec.n_params, strategy=self.spec.strategy)
            if snapshot is None or (stored is not None and stored.step >= snapshot.step):
                return None
            store = await self._store(engine)
            if store is None:
                logger.info("the surviving ranks hold the state at step %d, but this job has no "
                            "checkpoint= to regroup through and no live worker to keep it in "
                            "memory", snapshot.step)
                return None
            # Named for the generation it starts: a checkpoint of this generation's at the same
            # step may be the half-written one of the lost holder.
            info = await store.write(engine, self.state,
                                     manifest(snapshot.ledger, snapshot.rng), step=snapshot.step,
                                     generation=self.state.generation + 1, pause_s=0.0)
            restore = None if info is None else store.load(n_params=self.spec.n_params,
                                                           strategy=self.spec.strategy)
        except Exception as exc:  # noqa: BLE001 - the stored checkpoint is the way back
            logger.info("the surviving ranks' state could not be taken (%s: %s)",
                        type(exc).__name__, exc)
            return None
        if restore is not None and store is self.checkpoints and info is not None:
            self.log.checkpoints.append({**info, "survivors": True})
        if restore is not None:
            logger.info("the surviving ranks' state at step %d was taken in %.2f s",
                        restore.step, time.monotonic() - t0)
        return restore

    def _outlives_workers(self, engine: Engine) -> bool:
        """Whether the hand-over's state can be written where no worker holds it (the job's
        store, or this machine's memory), for workers that come later."""
        return self.checkpoints is not None or memory_place_of(
            self.spec.memory_state, engine.roles.addresses) is MemoryPlace.MACHINE

    async def _still_there(self, engine: Engine, workers: Iterable[str]) -> None:
        """Raise WorkerLost when one of the held ``workers`` no longer answers, or when no
        other worker is left to hold the state handed over (the whole cluster is closing).
        With a store that outlives the workers, every worker may leave at once (each
        ``--lifetime`` ending together, or the last one restarting): the hand-over goes on for
        up to :data:`ALONE_S`, the state is written there, and the next generation waits for
        workers to join (``GenerationPlacement.enough``)."""
        workers = set(workers)
        for address in workers:
            try:
                await asyncio.wait_for(self.client.rpc(address).identity(), timeout=LOOK_S * 4)
            except asyncio.TimeoutError as exc:
                # A slow answer is not a death: a held worker on a loaded machine took longer.
                # Its port says which (a killed worker's refuses at once).
                if not await listens(address):
                    raise WorkerLost(f"the leaving worker {address} is gone (its port no "
                                     "longer answers)", worker=address) from exc
            except Exception as exc:
                raise WorkerLost(f"the leaving worker {address} is gone "
                                 f"({type(exc).__name__})", worker=address) from exc
        if not workers or set(await alive_workers(self.client, placeable=True)) - workers:
            self._alone_since = None
            return
        if not self._outlives_workers(engine):
            raise WorkerLost("no other worker is left to hand over to (the cluster is closing)")
        now = time.monotonic()
        self._alone_since = self._alone_since or now
        if now - self._alone_since > ALONE_S:
            raise WorkerLost(f"no other worker is left, and the hand-over did not end within "
                             f"{ALONE_S:g} s (the cluster is closing)")

    def record(self, departure: Departure, *, roles: Mapping[str, list[str]]) -> None:
        """Record and publish a regroup once the next generation is placed: a departure
        (``result.departures``), or an arrival (``result.arrivals``)."""
        record = {
            "time_s": self.log.elapsed(), "workers": list(departure.workers or departure.joined),
            "roles": list(departure.roles), "step": departure.restore.step,
            "generation": self.state.generation, "redone": 0,
            "hand_over_s": round(time.monotonic() - departure.noticed_at, 3),
            "directory": departure.restore.directory,
        }
        kind = "departure" if departure.workers else "arrival"
        (self.log.departures if departure.workers else self.log.arrivals).append(record)
        self.publisher.publish({"kind": kind, **record})
        logger.info("generation %d starts on %s from the state at step %d (%.2f s after %s); "
                    "nothing is trained again", self.state.generation, dict(roles),
                    departure.restore.step, record["hand_over_s"],
                    _what(set(departure.workers), set(departure.joined)))

    def close(self) -> None:
        """Remove the scratch store, if one was made."""
        if self._scratch is not None:
            drop_store(self._scratch)
            self._scratch = None
