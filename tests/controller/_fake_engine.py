"""A scripted in-memory engine for the controller's tests (see test_phases.py): it implements
the engine protocol, emits a scripted list of events over time, reports scripted failures,
answers pauses with a snapshot, writes small shard files through the controller's checkpoint
store and ends when told to; and the helpers that run the real controller with it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from distributed import Client, LocalCluster

from dask_train.checkpoint import CheckpointConfig, CheckpointStore
from dask_train.controller._controller import Controller, Outcome
from dask_train.controller._state import Phase
from dask_train.engines._events import Epochs, Event, Progress, Score
from dask_train.engines._protocol import Elastic, Emit, Ending, Engine, Snapshot
from dask_train.engines._spec import JobSpec, TrainSettings
from dask_train.policy._failure import Failure
from dask_train.policy._placement import Roles
from dask_train.policy._settings import OptimizerSettings
from dask_train.runtime._calls import alive_workers
from dask_train.runtime._cluster_view import ClusterView

N_PARAMS = 4
ROWS = 100  # training rows per epoch: a score after 250 samples is at epoch 2.5
S, R, C, RS, F, FD, E = (Phase.STARTING, Phase.RUNNING, Phase.CHECKPOINTING, Phase.RESTARTING,
                         Phase.FINISHING, Phase.FINISHED, Phase.ERRORED)


@dataclass(frozen=True)
class Fault:
    """A failure ``failures()`` reports once, ``at`` seconds after start and ``after_saves``
    checkpoint writes (and, with ``stopping``, once the engine was asked to stop)."""

    failure: Failure
    at: float = 0.0
    after_saves: int = 0
    stopping: bool = False


class FakeEngine(Engine):
    """One generation in memory: scripted events, failures, pauses, saves and an ending; a
    sync engine's (its trainers a group: a lost one is a restart). :class:`ElasticFakeEngine`
    is the async-ps one.

    ``calls`` records what the controller asked, in order (``"pause 1"``, ``"snapshot 1"``: the
    pause was answered, ``"save <checkpoint directory name>"``, ``"stop <keep_step>"``, ...).
    """

    def __init__(self, script: Iterable[tuple[float, Event]] = (), *, ends_at: float | None = None,
                 faults: Sequence[Fault] = (), final_score: dict[str, float] | None = None,
                 answers_pauses: int | None = None, pause_polls: int = 1,
                 start_error: Exception | None = None, stop_error: Exception | None = None,
                 leaving: Iterable[str] = ()) -> None:
        self.script = sorted(script, key=lambda entry: entry[0])
        self.ends_at, self.faults, self.final_score = ends_at, list(faults), final_score
        self.answers_pauses, self.pause_polls = answers_pauses, pause_polls
        self.start_error, self.stop_error = start_error, stop_error
        # Workers that announced they leave, as ``leaving()`` says once the start failed or
        # the stop began: a notice while the engine runs is a hand-over (test_departures.py).
        self.noticed = set(leaving)
        self.roles = Roles()
        self.calls: list[str] = []
        self.made_with: tuple[Roles, str, Mapping[str, Any] | None] | None = None
        self.step = self.samples = self.epochs = self.saves = 0
        self.scored: dict[int, np.ndarray] = {}
        self.pending = self.polls = 0
        self.adoptions = 0  # adopt_workers calls (an ElasticFakeEngine's)
        self.adopted_while_paused = 0  # of them, those with a pause outstanding
        self.reported: set[int] = set()
        self.stopped = False
        self.t0 = 0.0
        self.feeder: asyncio.Task[None] | None = None

    # -- running ------------------------------------------------------------------------------
    async def start(self, emit: Emit) -> None:
        self.calls.append("start")
        if self.start_error is not None:
            self.t0 = time.monotonic()  # a fault's ``at`` counts from the failed start too
            raise self.start_error
        restore = self.made_with[2] if self.made_with else None
        if restore is not None:
            self.step, self.samples = int(restore["step"]), int(restore["samples"])
        self.t0 = time.monotonic()
        self.feeder = asyncio.get_running_loop().create_task(self._feed(emit))

    async def _feed(self, emit: Emit) -> None:
        for at, event in self.script:
            delay = self.t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if isinstance(event, Progress):
                self.step, self.samples = max(self.step, event.step), event.step * 10
            elif isinstance(event, Score):
                self.scored[event.step] = np.full(N_PARAMS, float(event.step))
            elif isinstance(event, Epochs):
                self.epochs = event.completed
            emit(event)

    async def tick(self, now: float) -> str:
        # Paused trainers cannot finish: the engine ends only with no pause outstanding.
        done = self.feeder is not None and self.feeder.done()
        if self.ends_at is not None and done and not self.pending and \
                time.monotonic() - self.t0 >= self.ends_at:
            return "trainers ended"
        return ""

    def epochs_completed(self) -> int:
        return self.epochs

    def reported_step(self) -> int:
        return self.step

    async def exact_step(self) -> int:
        self.calls.append("exact_step")
        return self.step

    def ledger_state(self) -> dict[str, Any]:
        return {"epochs": self.epochs, "step": self.step}

    def ledger_records(self) -> list[dict[str, Any]]:
        return [{"epoch": 0, "block": 0, "consumed": self.samples}]

    # -- failures -----------------------------------------------------------------------------
    async def failures(self, view: ClusterView) -> list[Failure]:
        elapsed = time.monotonic() - self.t0
        due = [i for i, f in enumerate(self.faults) if i not in self.reported
               and elapsed >= f.at and self.saves >= f.after_saves
               and (self.stopped or not f.stopping)]
        self.reported.update(due)
        return [self.faults[i].failure for i in due]

    def leaving(self) -> set[str]:
        return set(self.noticed) if self.stopped or self.start_error is not None else set()

    async def replace_scorer(self, alive: Mapping[str, int]) -> None:
        self.calls.append(f"replace scorer on {len(alive)} worker(s)")

    # -- checkpoints --------------------------------------------------------------------------
    def running(self) -> bool:
        return not self.stopped

    async def pause(self, pause_id: int) -> None:
        self.calls.append(f"pause {pause_id}")
        self.pending, self.polls = pause_id, 0

    def paused(self, pause_id: int) -> Snapshot | None:
        if pause_id != self.pending or (self.answers_pauses is not None
                                        and pause_id > self.answers_pauses):
            return None
        self.polls += 1
        if self.polls <= self.pause_polls:  # the trainers have not all paused yet
            return None
        self.calls.append(f"snapshot {pause_id}")
        return Snapshot(step=self.step, ledger={"paused_at": self.step},
                        rng={"0": f"rng-{self.step}"})

    async def resume(self, pause_id: int) -> None:
        self.calls.append(f"resume {pause_id}")
        self.pending = 0

    async def save(self, *, directory: str, paths: Callable[[int], str],
                   metadata: Mapping[str, str]) -> list[dict[str, Any]]:
        self.calls.append(f"save {Path(directory).name}")
        shard = Path(paths(0))
        shard.parent.mkdir(parents=True, exist_ok=True)
        shard.write_bytes(b"a small shard")
        self.saves += 1
        return [{"index": 0, "start": 0, "stop": N_PARAMS, "version": self.step,
                 "samples": self.samples, "finite": True}]

    # -- ending -------------------------------------------------------------------------------
    async def stop(self, *, keep_step: int | None) -> Ending:
        self.calls.append(f"stop {keep_step}")
        self.stopped, self.pending = True, 0  # a pause outstanding is released, as engines do
        if self.feeder is not None:
            self.feeder.cancel()
        if self.stop_error is not None:  # once: stopping again (without a lost role) succeeds
            error, self.stop_error = self.stop_error, None
            raise error
        final: dict[str, Any] | None = None
        if keep_step is not None and keep_step in self.scored:
            final = {"record": None, "params": self.scored[keep_step]}
        elif self.final_score is not None:
            final = {"record": Score(step=self.step, samples=self.samples,
                                     metrics=dict(self.final_score)), "params": None}
        return Ending(params=np.full(N_PARAMS, -1.0), steps=self.step, samples=self.samples,
                      trainers=[{"trainer": 0, "steps": self.step}], final=final,
                      rng={"0": "rng-end"})

    async def close(self) -> None:
        self.calls.append("close")
        if self.feeder is not None:
            self.feeder.cancel()


class ElasticFakeEngine(FakeEngine, Elastic):
    """As :class:`FakeEngine`, with the async-ps engine's independent trainers: a lost one is
    retired (the job goes on), a joined worker adopted."""

    strategy = "async-ps"

    async def retire_trainer(self, index: int) -> None:
        self.calls.append(f"retire {index}")

    async def adopt_workers(self, alive: Mapping[str, int]) -> None:
        # Kept apart from ``calls``: the controller asks at every pass.
        self.adoptions += 1
        self.adopted_while_paused += bool(self.pending)


# -- driving the real controller -------------------------------------------------------------------
@dataclass
class Run:
    controller: Controller
    outcome: Outcome | None
    error: BaseException | None
    published: list[dict[str, Any]] = field(default_factory=list)

    @property
    def phases(self) -> list[Phase]:
        """Every phase the job went through, the last one included."""
        return [*self.controller.state.history, self.controller.state.phase]

    @property
    def kinds(self) -> list[str]:
        return [m["kind"] for m in self.published]


def _spec(**kw: Any) -> JobSpec:
    train: dict[str, Any] = dict(module=None, n_params=N_PARAMS, loss="mse",
                                 optim=OptimizerSettings("adam", 0.01), prefetch=1, score_every=0.1)
    train.update({k: kw.pop(k) for k in list(kw) if k in TrainSettings.__dataclass_fields__})
    settings: dict[str, Any] = dict(
        batch_size=10, epochs=1, shuffle=False, seed=0, blocks_ahead=1, timeout=5.0, stop=[],
        callbacks=[], progress=False, strategy="sync", workers=1, job_id="phases",
        train=TrainSettings(**train))
    settings.update(kw)
    return JobSpec(**settings)


def _run(engines: Sequence[FakeEngine], spec: JobSpec, *, resume: bool = False,
         plan: Callable[[Mapping[str, int]], Roles] | None = None,
         roles: Mapping[str, int] | None = None,
         before: Callable[[Client, str], Awaitable[None]] | None = None) -> Run:
    """Run the controller over ``engines`` (one per generation) on a fresh in-process cluster;
    ``roles`` counts the first generation's roles by kind, all on its one worker. With
    ``before``, the cluster has a second worker, and ``before(client, its address)`` runs
    before the job starts."""

    async def main() -> Run:
        async with LocalCluster(processes=False, n_workers=1 if before is None else 2,
                                threads_per_worker=1, dashboard_address=":0",
                                asynchronous=True) as cluster, \
                Client(cluster, asynchronous=True) as client:
            worker, *other = sorted(await alive_workers(client))
            if before is not None:
                await before(client, other[0])
            made = iter(engines)

            def make_engine(roles: Roles, job: str, restore: Mapping[str, Any] | None) -> Engine:
                engine = next(made)
                engine.made_with, engine.roles = (roles, job, restore), roles
                return engine

            first = Roles({kind: [worker] * n for kind, n in (roles or {"trainer": 1}).items()})
            controller = Controller(
                client, spec, make_engine=make_engine, roles=first, rows=ROWS,
                plan_roles=plan or (lambda live: Roles({"trainer": sorted(live)})))
            outcome, error = None, None
            try:
                outcome = await asyncio.wait_for(controller.run(resume=resume), 20)
            except Exception as exc:
                error = exc
            published: list[dict[str, Any]] = []
            for _ in range(40):  # an error's "end" is sent without waiting for the scheduler
                published = [m for _, m in await client.get_events(f"dask-train-{spec.job_id}")]
                if published and published[-1]["kind"] == "end":
                    break
                await asyncio.sleep(0.05)
            return Run(controller, outcome, error, published)

    return asyncio.run(main())


def _ok(run: Run) -> Outcome:
    assert run.error is None, f"the job raised {run.error!r}"
    assert run.outcome is not None
    return run.outcome


def _score(step: int, **metrics: float) -> Score:
    return Score(step=step, samples=step * 25, metrics=metrics)


def _manifest(directory: str) -> dict[str, Any]:
    return dict(json.loads((Path(directory) / "manifest.json").read_text()))


def _earlier_checkpoint(config: CheckpointConfig, *, step: int) -> dict[str, Any]:
    """Write a complete checkpoint at ``step`` as an earlier fit would have; its history row."""
    store = CheckpointStore(config)
    directory = store.directory(step, 0)
    shard = Path(store.shard_path(directory, 0))
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"a small shard")
    earlier = {"time_s": 1.0, "step": step, "epoch": step / ROWS, "samples": step * 10,
               "loss": 0.9}
    store.write_manifest(directory, {
        "shards": [shard.name], "files": [{"index": 0, "start": 0, "stop": N_PARAMS}],
        "step": step, "samples": step * 10, "ledger": {"paused_at": step},
        "n_params": N_PARAMS, "strategy": "sync", "records": [earlier], "elapsed_s": 2.0,
        "stop": []})
    return earlier


# -- stop decisions --------------------------------------------------------------------------------
