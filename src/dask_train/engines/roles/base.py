"""Engines whose roles are long-running Dask tasks fed block by block: async-ps, sync torch, dt.run.

What they share: roles pinned to their workers, blocks granted from the ledger as trainers free
queue slots (by one RPC for a local block, by a task otherwise), the shared scorer, pauses and
shard writes for checkpoints, stopping and pulling, and watching the workers the roles live on.
Subclasses differ in their servers (parameter servers, or rank 0's own) and trainer function.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from distributed import Client, Future
from distributed.comm import CommClosedError

from dask_train.data._blocks import BlockSet, SpreadValidation
from dask_train.engines._events import Block, Epochs, Exit, Leaving, Paused, Progress, from_message
from dask_train.engines._protocol import Emit, Ending, Engine, Snapshot
from dask_train.engines._spec import JobSpec, RoleConfig, TrainSettings
from dask_train.engines.harness import control as worker_side
from dask_train.engines.holders.reach import pull_params_task
from dask_train.engines.holders.ref import ShardRef
from dask_train.engines.roles.granting import Granter, pin
from dask_train.engines.roles.sending import EMBED_MODULE_BYTES, is_lost, send_module
from dask_train.engines.roles.waiting import RoleTasks, raise_role_error
from dask_train.errors import TrainingTimeout, WorkerLost
from dask_train.models._transport import travelling
from dask_train.policy._failure import Failure
from dask_train.policy._ledger import Ledger, patch_positions
from dask_train.policy._placement import Roles
from dask_train.runtime._calls import run_direct, run_on_live
from dask_train.runtime._cluster_view import ClusterView, look
from dask_train.runtime._compat import drop_topic_handler
from dask_train.runtime._plugin import heard_leaving, let_go

logger = logging.getLogger(__name__)
#: What a role gets when a peer went away (a server's connection, a sync rank's collective).
_PEER_ERRORS = (OSError, CommClosedError, TrainingTimeout)


class RoleEngine(Engine):
    """Base of the engines whose trainers are pinned tasks reading per-trainer feed queues.

    Parameters
    ----------
    client : distributed.Client
    spec : JobSpec
    roles : Roles
        Where each role runs in this generation.
    blocks : BlockSet
        The persisted training blocks.
    validation : (numpy.ndarray, numpy.ndarray) or None
    job : str
        This generation's key on the workers: its state, tasks and events never mix with an
        older generation's stragglers.
    restore : mapping, optional
        ``{"ledger", "rng", "files", "step", "samples"}`` of the checkpoint to start from.
    """

    #: The trainer task; set by subclasses.
    run_trainer: Callable[..., Any]

    def __init__(
        self, client: Client, spec: JobSpec, roles: Roles, blocks: BlockSet, validation: Any,
        *, job: str, restore: Mapping[str, Any] | None = None,
    ) -> None:
        self.client, self.spec, self.roles, self.blocks = client, spec, roles, blocks
        self.validation, self.job, self.restore = validation, job, restore
        trainers = roles["trainer"]
        kwargs: dict[str, Any] = {"epochs": spec.epochs, "shuffle": spec.shuffle, "seed": spec.seed}
        self.ledger = (Ledger.from_state(blocks.blocks, trainers, state=restore["ledger"], **kwargs)
                       if restore is not None else Ledger(blocks.blocks, trainers, **kwargs))
        # Workers that announced they are leaving with notice (Leaving): removed from the
        # scheduler, held by dask-train's plugin, reached directly until the hand-over ends.
        self.leaving_workers: set[str] = set()
        self.shards = self.make_shards()
        # Every wait on this generation's role tasks, and its holders' file writes.
        # Nothing of it points back at the engine (a weak method for the holders): a cycle
        # would keep the generation's futures until the collector ran.
        self.tasks = RoleTasks(client, job=job, timeout=spec.timeout,
                               pin=functools.partial(pin, client, job),
                               leaving=self.leaving_workers,
                               holders=weakref.WeakMethod(self.default_holders))
        self.emit: Emit = lambda event: None
        self.granter = Granter(client=client, blocks=blocks, ledger=self.ledger, job=job, seed=spec.seed,
                               shuffle=spec.shuffle, trainers=trainers, ahead=spec.blocks_ahead,
                               out_of_blocks=type(self).out_of_blocks, most_ahead=spec.blocks_ahead_max)
        self.granter.leaving = self.leaving_workers
        self.exited: set[int] = set()  # trainers whose last event has arrived
        self.trainer_steps: dict[int, int] = {}
        self.trainer_futures: list[Future] = []
        self.scorer_future: Future | None = None
        self.scorer_restarts = 0
        self.module_f: Future | None = None
        self.config: RoleConfig | None = None
        self.finished_at = 0.0
        self.last_heartbeat = 0.0
        self.pauses: dict[int, dict[int, Paused]] = {}
        # The latest pause requested and resume sent, for a leaving worker that missed them.
        self.requested_pause = self.resumed_upto = 0
        self.subscribed = False  # to this generation's topic (not yet when its start failed)

    @property
    def topic(self) -> str:
        """The event topic of this generation's trainers and scorer."""
        return f"dask-train-{self.job}"

    def make_shards(self) -> list[ShardRef]:
        """Where the job's parameters are held (and the scorer reads them)."""
        raise NotImplementedError

    async def start_servers(self) -> None:
        """Start whatever holds the parameters before the trainers start."""

    @property
    def train(self) -> TrainSettings:
        """The model this engine trains and how (every role engine but ``dt.run``'s)."""
        assert self.spec.train is not None, f"{type(self).__name__} trains a given model"
        return self.spec.train

    def trainer_config(self) -> RoleConfig:
        """Settings every trainer (and the scorer) receives."""
        return RoleConfig.from_spec(self.spec, topic=self.topic, restore=self.restore)

    # -- starting ---------------------------------------------------------------------------------
    def pinned(self, fn: Any, *args: Any, address: str, key: str, **kwargs: Any) -> Future:
        """Submit ``fn`` to run exactly once on ``address`` (see :func:`.granting.pin`)."""
        return pin(self.client, self.job, fn, *args, address=address, key=key, **kwargs)

    async def start(self, emit: Emit) -> None:
        """Start servers, the scorer and the trainers; grant every trainer its first blocks."""
        self.emit = emit
        self.module_f = await send_module(self.client, travelling(self.train.module), self.job)
        await self.start_servers()
        self.config = self.trainer_config()
        self.client.subscribe_topic(self.topic, lambda event: self._on_event(event[1]))
        self.subscribed = True
        if self.validation is not None and self.roles["scorer"]:
            await self.start_scorer(self.roles["scorer"][0])
        for i, address in enumerate(self.roles["trainer"]):
            self.trainer_futures.append(self._trainer_task(i, address))
        # Round-robin over the trainers, so the first cannot take every block of a small job
        # before the others get one.
        for _ in range(self.spec.blocks_ahead):
            for i in range(len(self.roles["trainer"])):
                self.granter.grant(i)

    async def module_again(self) -> None:
        """Send the model again if its scattered copy was lost with its worker (a replaced
        scorer or a joining trainer takes it as an argument; see :func:`send_module`)."""
        if self.module_f is not None and is_lost(self.module_f):
            self.module_f = await send_module(self.client, travelling(self.train.module), self.job)
            logger.info("job %s: the model was sent again: the worker holding it was lost",
                        self.job)

    def _trainer_task(self, index: int, address: str) -> Future:
        return self.pinned(type(self).run_trainer, self.module_f, address=address,
                           key=f"dt-trainer-{index}", job=self.job, index=index,
                           shards=self.shards, config=self.config,
                           resources=self.spec.placement.task_resources)

    async def start_scorer(self, address: str) -> None:
        """Start (or restart, on another worker) the scorer on ``address``."""
        config = self.config
        assert config is not None, "start() sets the roles' config before the scorer starts"
        if isinstance(self.validation, SpreadValidation):
            # Scored where its blocks live (engines.scoring.spread_eval): nothing moves to the scorer.
            val_f = None
            config = dataclasses.replace(config, validation_keys=list(self.validation.keys))
        elif sum(getattr(a, "nbytes", 0) for a in self.validation) <= EMBED_MODULE_BYTES:
            # Inside the scorer's task: nothing scattered is lost with its worker (a replaced
            # scorer gets the pair again the same way).
            val_f = self.validation
        else:
            [val_f] = await self.client.scatter([self.validation], workers=[address], hash=False,
                                                asynchronous=True)
        # Here, not at the module's top: the scorer's worker side imports torch, which the
        # controller's process of a job without one (dt.run's) never needs.
        from dask_train.engines.scoring.scorer import run_scorer

        suffix = f"-r{self.scorer_restarts}" if self.scorer_restarts else ""
        await self.module_again()
        self.scorer_future = self.pinned(
            run_scorer, self.module_f, val_f, address=address, key=f"dt-scorer{suffix}",
            job=self.job, shards=self.shards, config=config)
        self.roles = self.roles.replace("scorer", [address])

    # -- feeding ----------------------------------------------------------------------------------
    def live(self) -> list[int]:
        """Trainers not lost (retired)."""
        return self.granter.live()

    @property
    def stopping(self) -> bool:
        """True once the generation is stopping: no block is granted any more."""
        return self.granter.stopping

    #: What a trainer out of blocks gets (see :class:`.granting.Granter`): a sync rank its end
    #: marker at once; the async engine overrides this.
    out_of_blocks: ClassVar[Callable[[Granter, int], bool]] = Granter.end_now

    def live_trainers(self) -> int:
        """Trainers still taking part."""
        return len(self.live())

    # -- events -----------------------------------------------------------------------------------
    def _on_event(self, message: dict[str, Any]) -> None:
        event = from_message(message)
        if isinstance(event, Block):
            if event.trainer in self.granter.retired:
                return
            self.trainer_steps[event.trainer] = event.steps
            before = self.ledger.epochs_completed
            self.ledger.consumed(epoch=event.epoch, block=event.block, trainer=event.trainer,
                                 rows=event.rows, done=event.done)
            self.granter.granted(event.trainer, starved=event.starved)
            self.granter.end_idle()
            if self.ledger.epochs_completed > before:
                self.emit(Epochs(completed=self.ledger.epochs_completed))
            self.emit(Progress(step=self.reported_step()))
        elif isinstance(event, Paused):
            self.trainer_steps[event.trainer] = event.steps
            self.pauses.setdefault(event.id, {})[event.trainer] = event
        elif isinstance(event, Exit):
            self.exited.add(event.trainer)
        elif isinstance(event, Leaving):
            if event.address not in self.leaving_workers:
                self.leaving_workers.add(event.address)
                self._answer(event.address)
                self._catch_up(event.address)
                # Its feed tasks that had not run are sent again directly; the dropped futures
                # release their keys.
                self.granter.redirect(event.address)
        else:  # started, score, nan, stats: the controller's
            self.emit(event)

    def epochs_completed(self) -> int:
        """Epochs whose every block was reported consumed."""
        return int(self.ledger.epochs_completed)

    def ledger_records(self) -> list[dict[str, Any]]:
        """The ledger's rows."""
        return list(self.ledger.records())

    def ledger_state(self) -> dict[str, Any]:
        """The ledger's state (a manifest's ``ledger``)."""
        state: dict[str, Any] = self.ledger.state()
        return state

    async def exact_step(self) -> int:
        """The update count of the first parameter holder (every holder steps together); -1
        when its worker is gone (the controller's failure check handles that next)."""
        ref = self.shards[0]
        counts = await run_on_live(self.client, worker_side.shard_version, self.job, ref.index,
                                   leaving=self.leaving_workers, workers=[ref.address])
        count = counts.get(ref.address, -1)
        return count if isinstance(count, int) else -1

    def reported_step(self) -> int:
        """The step as the trainers last reported it: every rank reports the shared step (a
        sync job's); engines whose trainers count their own updates override this."""
        base = int(self.restore["step"]) if self.restore is not None else 0
        return max(self.trainer_steps.values(), default=base)

    async def tick(self, now: float) -> str:
        """Detect the natural end; keep idle trainers' feed waits alive."""
        live = [self.trainer_futures[i] for i in self.live()]
        if live and all(i in self.exited for i in self.live()):
            return "trainers ended"
        if live and all(f.status == "finished" for f in live):
            # A trainer's last events and its task's completion travel separately: give the
            # events a moment to arrive before deciding why the job ended.
            self.finished_at = self.finished_at or now
            if now - self.finished_at > 5.0:
                return "trainers ended"
        elif any(self.granter.idle) and now - self.last_heartbeat > self.spec.timeout / 4:
            self.last_heartbeat = now
            self.granter.keep_idle_alive(now)
        return ""

    # -- failures ---------------------------------------------------------------------------------
    async def failures(self, view: ClusterView) -> list[Failure]:
        """Roles on workers that left (``view``, the controller's listing of this pass, no
        longer has them); then roles that raised (the scorer's error is a failure, a trainer's
        is the user's and raises RoleFailed, unless a peer's death caused it)."""
        lost = self._lost_roles(view)
        if lost:
            return lost
        scorer = self.scorer_future
        if scorer is not None and scorer.status == "error":
            exc = await scorer.exception()
            return [Failure("scorer", 0, self.roles["scorer"][0],
                            f"the scorer raised {type(exc).__name__}: {exc}")]
        for attempt in range(21):
            # Not every trainer's task exists when a generation's start failed before them.
            futs = {i: self.trainer_futures[i] for i in self.live()
                    if i < len(self.trainer_futures)}
            errors = {i: await f.exception() for i, f in futs.items() if f.status == "error"}
            # A trainer whose own code raised is the cause; its peers' lost connections (a sync
            # rank's gloo or host-memory sum) are its effect, whichever arrived first.
            own = [i for i, e in errors.items() if not isinstance(e, _PEER_ERRORS)]
            if own or (errors and attempt == 20):
                i = (own or sorted(errors))[0]
                await raise_role_error(futs[i], f"trainer-{i} on {self.roles['trainer'][i]}")
            if not errors:
                break
            # Only lost connections: usually a peer's worker died (a server, a rank): wait for
            # the scheduler to notice, so the root cause is what the policy sees: a listing
            # newer than the pass's, which was taken before that death showed.
            await asyncio.sleep(0.1)
            if lost := self._lost_roles(await look(self.client)):
                return lost
        granter = self.granter
        for _trainer, fut in granter.feeds:
            if fut.status == "error":
                await raise_role_error(fut, f"feeding block task {fut.key}")
        granter.refeed_cancelled()
        granter.forget_done()
        return []

    def _lost_roles(self, view: ClusterView) -> list[Failure]:
        """Roles on workers ``view`` does not list (a retired trainer's worker is no role's)."""
        gone = view.lost(self.roles.addresses)
        return [Failure(kind, i, address, f"the Dask worker {address} left the cluster")
                for kind in ("ps", "trainer", "scorer")
                for i, address in enumerate(self.roles.get(kind, []))
                if address in gone and not (kind == "trainer" and i in self.granter.retired)]

    async def replace_scorer(self, alive: Mapping[str, int]) -> None:
        """Start the scorer on the least-loaded live worker."""
        old = self.scorer_future
        if old is not None and old.status == "pending":
            await self.client.cancel([old], asynchronous=True)
        used = {a: 0.0 for a in alive}
        for kind, weight in (("trainer", 1.0), ("ps", 0.5)):
            for address in self.roles.get(kind, []):
                if address in used:
                    used[address] += weight
        self.scorer_restarts += 1
        await self.start_scorer(min(sorted(used), key=lambda a: used[a]))

    # -- checkpoints ------------------------------------------------------------------------------
    def running(self) -> bool:
        """True while a live trainer's task is still running."""
        return any(self.trainer_futures[i].status == "pending" for i in self.live())

    def _running(self) -> list[int]:
        return [i for i in self.live() if self.trainer_futures[i].status == "pending"]

    async def pause(self, pause_id: int) -> None:
        """Raise the pause id on every running trainer's worker."""
        self.pauses[pause_id] = {}
        self.requested_pause = pause_id
        workers = sorted({self.roles["trainer"][i] for i in self._running()})
        await run_on_live(self.client, worker_side.request_pause, self.job, pause_id,
                          leaving=self.leaving_workers, workers=workers)

    def awaited(self, pause_id: int) -> list[int]:
        """The trainers pause ``pause_id`` waits for: every running one."""
        return self._running()

    def paused(self, pause_id: int) -> Snapshot | None:
        """The awaited trainers' pause reports as a snapshot (at the reported step)."""
        reports = self.pauses.get(pause_id, {})
        if not all(t in reports for t in self.awaited(pause_id)):
            return None
        positions = {t: e.position for t, e in reports.items()}
        return Snapshot(step=self.reported_step(),
                        ledger=patch_positions(self.ledger.state(), positions),
                        rng={str(t): e.rng for t, e in reports.items()})

    async def resume(self, pause_id: int) -> None:
        """Let every trainer paused for ``pause_id`` go on."""
        self.pauses.pop(pause_id, None)
        self.resumed_upto = max(self.resumed_upto, pause_id)
        await run_on_live(self.client, worker_side.resume, self.job, pause_id,
                          leaving=self.leaving_workers, workers=self.roles.addresses)

    def _answer(self, address: str, fn: Any = heard_leaving) -> None:
        """Tell a leaving worker its notice was heard (it stays for the hand-over), or, with
        ``fn=let_go``, that its hand-over failed (it need not stay)."""

        async def answer() -> None:
            try:
                await asyncio.wait_for(run_direct(self.client, fn, address=address),
                                       timeout=5.0)
            except Exception:  # gone already: its loss is found as any other
                logger.info("job %s: the leaving worker %s did not take the answer",
                            self.job, address)

        task = asyncio.get_running_loop().create_task(answer())
        self.granter.direct_feeds.add(task)  # held until done, as the direct feeds are
        task.add_done_callback(self.granter.direct_feeds.discard)

    def _catch_up(self, address: str) -> None:
        """Send a leaving worker the pause still pending and the latest resume, directly.

        The scheduler drops a retiring worker before its notice reaches the job: a call sent
        through the scheduler's list meanwhile (:func:`run_on_live`) left it out. A ``dt.run``
        rank on it then waited at its report for a resume that never came, until the hand-over
        gave up (a retirement right after a report, 2 runs in 10 under load)."""
        pending = self.requested_pause if self.requested_pause in self.pauses else 0
        self._answer(address, functools.partial(worker_side.catch_up, self.job, pending,
                                                self.resumed_upto))

    def leaving(self) -> set[str]:
        """Workers of this generation's roles that announced they are leaving with notice."""
        return self.leaving_workers & set(self.roles.addresses)

    def left(self, workers: set[str]) -> None:
        """No more direct calls to ``workers``: a dead one's address would be retried until
        Dask's connect timeout."""
        for address in workers & self.leaving_workers:
            self._answer(address, let_go)
        self.leaving_workers -= workers  # the granter shares the set

    async def save(self, *, directory: str, paths: Callable[[int], str],
                   metadata: Mapping[str, str]) -> list[dict[str, Any]]:
        """Each parameter holder writes its own file, in parallel, atomically."""
        written = await self.tasks.write_holders(
            [(ref.index, ref.address, {**metadata, "start": str(ref.start),
                                       "stop": str(ref.stop)}) for ref in self.shards],
            paths=paths, directory=directory)
        return [{**written[ref.index], "index": ref.index, "start": ref.start, "stop": ref.stop}
                for ref in self.shards]

    def default_holders(self) -> Mapping[str, str]:
        """The holders a wait on role tasks watches unless told others: the parameter holders'
        addresses -> roles."""
        return {ref.address: f"parameter holder {ref.index}" for ref in self.shards}

    # -- ending -----------------------------------------------------------------------------------
    async def stop(self, *, keep_step: int | None) -> Ending:
        """Stop every role (each wait bounded by the timeout); pull the final parameters. A role
        lost meanwhile raises WorkerLost; once acted on, stopping again goes on without it."""
        self.granter.stopping = True
        scorer = self.scorer_future is not None
        if scorer and keep_step is not None:
            # A score stopped the job: stop the scorer first, while it still holds the snapshot
            # that earned the score (it keeps the last few; stopping slow trainers takes long
            # enough for newer scores to push it out).
            await run_on_live(self.client, worker_side.signal_stop, self.job, scorer=True,
                              keep_step=keep_step, leaving=self.leaving_workers,
                              workers=self.roles["scorer"])
        for pause_id in list(self.pauses):
            await self.resume(pause_id)
        await run_on_live(self.client, worker_side.signal_stop, self.job,
                          leaving=self.leaving_workers, workers=self.roles.addresses)
        live = [self.trainer_futures[i] for i in self.live()]
        trainers = await self.tasks.gather_from_holders(live, what="stopping the trainers", holders={
            self.roles["trainer"][i]: f"trainer-{i}" for i in self.live()})
        await self._drain_events()
        final = None
        if self.scorer_future is not None:
            if keep_step is None:  # the final parameters' score, once the trainers stopped
                await run_on_live(self.client, worker_side.signal_stop, self.job, scorer=True,
                                  keep_step=None, leaving=self.leaving_workers,
                                  workers=self.roles["scorer"])
            [final] = await self.tasks.gather_from_holders(
                [self.scorer_future], what="the final score",
                holders={self.roles["scorer"][0]: "scorer-0"})
        parts = await self._pull_final()
        import numpy as np

        return Ending(params=np.concatenate([p[0] for p in parts]),
                      steps=min(p[1] for p in parts), samples=min(p[2] for p in parts),
                      trainers=trainers, final=final,
                      rng={str(t["trainer"]): t["rng"] for t in trainers if t.get("rng")},
                      buffers=next((p[3] for p in parts if p[3] is not None), None))

    async def _pull_final(self) -> list[Any]:
        """Each parameter holder's (parameters, version, samples, buffers) at the end: through a
        task pinned to its worker, or straight from the pull handler of a worker that is leaving
        with notice (the scheduler no longer lists it; it is held while the job has state on
        it). A job stopped as a holder's worker retired once lost that holder's parameters
        and started over from its last copy, or from the initial parameters."""
        held = [ref for ref in self.shards if ref.address in self.leaving_workers]
        listed = [ref for ref in self.shards if ref not in held]
        pulls = [self.pinned(pull_params_task, address=ref.address, key=f"dt-pull-{ref.index}",
                             job=self.job, index=ref.index) for ref in listed]
        parts: dict[int, Any] = {}
        if pulls:
            got = await self.tasks.gather_from_holders(
                pulls, what="pulling the final parameters",
                holders={ref.address: f"parameter holder {ref.index}" for ref in listed})
            parts.update(zip((ref.index for ref in listed), got))
        for ref in held:
            try:
                reply = await asyncio.wait_for(self.client.rpc(ref.address).dask_train_pull(
                    job=self.job, shard=ref.index), timeout=min(30.0, self.spec.timeout))
            except Exception as exc:  # gone meanwhile: its loss is the controller's to act on
                raise WorkerLost(f"the leaving worker {ref.address} of parameter holder "
                                 f"{ref.index} is gone ({type(exc).__name__})",
                                 worker=ref.address) from exc
            if "missing" in reply:
                raise WorkerLost(f"parameter holder {ref.index} is no longer on the leaving "
                                 f"worker {ref.address}: {reply['missing']}", worker=ref.address)
            parts[ref.index] = (reply["params"], int(reply["version"]), int(reply["samples"]),
                                reply.get("buffers"))
        return [parts[ref.index] for ref in self.shards]

    async def _drain_events(self) -> None:
        """Wait (briefly) for the trainers' last events, so the ledger holds every report."""
        deadline = time.monotonic() + min(10.0, self.spec.timeout)
        while not all(i in self.exited for i in self.live()):
            if time.monotonic() > deadline:
                logger.warning("job %s: the last events of trainers %s did not arrive", self.job,
                               sorted(set(self.live()) - self.exited))
                return
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        """Unsubscribe, cancel what still runs, and drop the job's state on its workers."""
        try:
            await asyncio.wait_for(self._close(), timeout=self.spec.timeout)
        except Exception:  # closing must not hide the job's own error
            logger.exception("cleaning up job %s failed", self.job)

    async def _close(self) -> None:
        self.granter.stopping = True
        if self.subscribed:  # unsubscribe_topic raises for a topic never subscribed
            self.client.unsubscribe_topic(self.topic)
            # unsubscribe_topic only tells the scheduler; the client keeps the handler, and with
            # it this engine, its blocks and role futures, for as long as the client lives.
            drop_topic_handler(self.client, self.topic)
            self.subscribed = False
        pending = [f for f in self.trainer_futures if f.status == "pending"]
        pending += [f for _, f in self.granter.feeds if f.status == "pending"]
        if self.scorer_future is not None and self.scorer_future.status == "pending":
            pending.append(self.scorer_future)
        if pending:
            # Tasks pinned to a lost worker wait in no-worker forever: cancel them.
            await self.client.cancel(pending, asynchronous=True)
        self.trainer_futures, self.granter.feeds, self.scorer_future = [], [], None
        holders: list[str] = []
        if isinstance(self.validation, SpreadValidation):
            # Workers that evaluated validation blocks keep a copy of the model for the job.
            who_has = await self.client.scheduler.who_has(keys=self.validation.keys)
            holders = [a for where in who_has.values() for a in where]
        await run_on_live(self.client, worker_side.drop_job, self.job,
                          leaving=self.leaving_workers,
                          workers=sorted(set(self.roles.addresses) | set(holders)))
