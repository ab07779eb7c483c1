"""A ``dt.run`` job's reports (``controller._reports.Reports``), without a cluster.

A small in-memory engine that reports, as ``dt.run``'s does (a
:class:`~dask_train.engines._protocol.Reporting` engine), writes its state through the real
checkpoint store in a temporary directory; the tests assert what each report leads to: the
checkpoint it carries written before its ranks go on, a copy of its state kept after they went
on, a hand-over taken at it, the last one written as the job finishes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from _fake_engine import N_PARAMS, _spec
from distributed import Client

from dask_train.checkpoint import CheckpointConfig
from dask_train.controller._checkpointing import Checkpoints
from dask_train.controller._publish import JobEvents
from dask_train.controller._reports import Reports
from dask_train.controller._state import JobLog, JobState, Phase
from dask_train.controller.cluster._departures import HandOvers
from dask_train.engines._events import ReportReady
from dask_train.engines._protocol import Emit, Ending, Engine, Reporting, Snapshot
from dask_train.errors import WorkerLost
from dask_train.policy._placement import Roles

#: No path these tests take asks the cluster (the live workers are asked only to hand over from a
#: report whose checkpoint a leaving worker kept from being written).
NO_CLUSTER = cast(Client, None)


class Ranks(Engine):
    """Ranks waiting at their reports: ``paused(id)`` is the report's snapshot, ``save`` writes
    one small file (or raises ``save_error`` once, or waits for ``gate``); ``calls`` records what
    was asked, in order. What reports is :class:`RanksEngine`."""

    strategy = "run"

    def __init__(self, *, step: int = 7, leaving: set[str] | None = None) -> None:
        self.roles = Roles({"trainer": ["tcp://a:1", "tcp://b:1"]})
        self.step = step
        self.calls: list[str] = []
        self.noticed = set(leaving or ())
        self.gate: asyncio.Event | None = None
        self.save_error: Exception | None = None

    async def start(self, emit: Emit) -> None:
        self.calls.append("start")

    async def tick(self, now: float) -> str:
        return ""

    def epochs_completed(self) -> int:
        return 0

    def reported_step(self) -> int:
        return self.step

    def ledger_state(self) -> dict[str, Any]:
        return {"step": self.step}

    def ledger_records(self) -> list[dict[str, Any]]:
        return []

    def leaving(self) -> set[str]:
        return set(self.noticed)

    def left(self, workers: set[str]) -> None:
        self.noticed -= workers

    def running(self) -> bool:
        return True

    async def pause(self, pause_id: int) -> None:
        self.calls.append(f"pause {pause_id}")

    def paused(self, pause_id: int) -> Snapshot | None:
        return Snapshot(step=self.step, ledger={"report": pause_id}, rng={"0": f"rng-{pause_id}"})

    async def resume(self, pause_id: int) -> None:
        self.calls.append(f"resume {pause_id}")

    async def save(self, *, directory: str, paths: Callable[[int], str],
                   metadata: Mapping[str, str]) -> list[dict[str, Any]]:
        self.calls.append(f"save {Path(directory).name}")
        if self.save_error is not None:
            error, self.save_error = self.save_error, None
            raise error
        if self.gate is not None:
            await self.gate.wait()
        shard = Path(paths(0))
        shard.parent.mkdir(parents=True, exist_ok=True)
        shard.write_bytes(b"a rank's state")
        return [{"index": 0, "start": 0, "stop": 0, "version": self.step,
                 "samples": 10 * self.step, "finite": True}]

    async def stop(self, *, keep_step: int | None) -> Ending:
        return Ending(params=None, steps=self.step, samples=10 * self.step, trainers=[])

    async def close(self) -> None:
        self.calls.append("close")


class RanksEngine(Ranks, Reporting):
    """:class:`Ranks` that report, as ``dt.run``'s: the controller never pauses them on a
    schedule; the newest report's state is held twice (no copy of it is kept)."""

    def report_copy(self) -> tuple[Snapshot, int] | None:
        return None


class OneHolder(RanksEngine):
    """As :class:`RanksEngine`, with the newest report's state on one worker alone."""

    def report_copy(self) -> tuple[Snapshot, int] | None:
        return Snapshot(step=self.step, ledger={"copy": True}, rng={}), self.step


class Job:
    """One job's bookkeeping around :class:`Reports`, as the controller holds it."""

    def __init__(self, tmp_path: Path, *, checkpoint: bool) -> None:
        self.spec = _spec(strategy="run")
        self.state, self.log = JobState(), JobLog()
        self.state.enter(Phase.RUNNING)
        self.checkpoints = Checkpoints(CheckpointConfig(str(tmp_path / "ckpt")), timeout=5.0) \
            if checkpoint else None
        self.copies = Checkpoints(CheckpointConfig(str(tmp_path / "copies")), timeout=5.0)
        self.copied = 0
        self.hand_overs = HandOvers(NO_CLUSTER, spec=self.spec, log=self.log, state=self.state,
                                    publisher=JobEvents(NO_CLUSTER, self.spec.job_id),
                                    checkpoints=self.checkpoints)
        self.reports = Reports(NO_CLUSTER, state=self.state, log=self.log,
                               checkpoints=self.checkpoints, hand_overs=self.hand_overs)
        self.records: list[dict[str, Any]] = [{"step": 1}]

    def manifest(self, ledger: dict[str, Any], rng: Mapping[str, str]) -> dict[str, Any]:
        return {"n_params": N_PARAMS, "strategy": "run", "ledger": ledger, "rng": dict(rng),
                "records": self.records}

    def mark_copied(self) -> None:
        self.copied += 1

    async def step(self, engine: Engine, *, copies: bool = False) -> Any:
        return await self.reports.step(engine, manifest=self.manifest,
                                       copies=self.copies if copies else None,
                                       copied=self.mark_copied)


def _manifests(root: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(root.glob("*/manifest.json"))]


def test_a_reports_checkpoint_is_written_before_its_ranks_go_on(tmp_path: Path) -> None:
    job, engine = Job(tmp_path, checkpoint=True), RanksEngine(step=7)

    async def main() -> Any:
        job.reports.take(ReportReady(id=3, checkpoint=True))
        return await job.step(engine)

    assert asyncio.run(main()) is None
    assert [c.split()[0] for c in engine.calls] == ["save", "resume"]
    assert engine.calls[-1] == "resume 3"
    assert [c["step"] for c in job.log.checkpoints] == [7]
    [manifest] = _manifests(tmp_path / "ckpt")
    assert manifest["ledger"] == {"report": 3} and manifest["step"] == 7
    assert job.reports.pending is None


def test_a_report_without_a_checkpoint_only_lets_its_ranks_go_on(tmp_path: Path) -> None:
    job, engine = Job(tmp_path, checkpoint=True), OneHolder()

    async def main() -> None:
        assert await job.step(engine, copies=True) is None  # no report yet: nothing asked
        job.reports.take(ReportReady(id=1, checkpoint=False))
        assert await job.step(engine, copies=True) is None

    asyncio.run(main())
    assert engine.calls == ["resume 1"]
    assert not job.log.checkpoints and job.reports.copy is None and job.copied == 0


def test_a_copy_of_a_lone_holders_report_is_written_after_its_ranks_went_on(
        tmp_path: Path) -> None:
    job, engine = Job(tmp_path, checkpoint=False), OneHolder(step=5)

    async def main() -> None:
        job.reports.take(ReportReady(id=2, checkpoint=True))
        assert await job.step(engine, copies=True) is None
        assert engine.calls == ["resume 2"]  # the copy is written while the ranks go on
        job.records.append({"step": 9})  # a score that came after the report
        assert job.reports.copy is not None
        await job.reports.copy

    asyncio.run(main())
    assert [c.split()[0] for c in engine.calls] == ["resume", "save"]
    [manifest] = _manifests(tmp_path / "copies")
    assert manifest["ledger"] == {"copy": True} and manifest["step"] == 5
    assert manifest["records"] == [{"step": 1}]  # the history as at the report
    assert job.copied == 1


def test_one_copy_at_a_time_and_one_being_written_is_dropped(tmp_path: Path) -> None:
    job, engine = Job(tmp_path, checkpoint=False), OneHolder()
    engine.gate = asyncio.Event()  # the copy's holder never finishes writing

    async def main() -> None:
        job.reports.take(ReportReady(id=1, checkpoint=True))
        await job.step(engine, copies=True)
        first = job.reports.copy
        await asyncio.sleep(0)  # the copy starts writing
        job.reports.take(ReportReady(id=2, checkpoint=True))
        await job.step(engine, copies=True)
        assert job.reports.copy is first  # the second report is copied at the next one
        await job.reports.drop()
        assert first is not None and first.cancelled()

    asyncio.run(main())
    assert [c.split()[0] for c in engine.calls] == ["resume", "save", "resume"]
    assert job.reports.copy is None and job.copied == 0
    assert not _manifests(tmp_path / "copies")  # a copy cut short is no checkpoint


def test_no_copy_of_an_engine_that_does_not_report(tmp_path: Path) -> None:
    job, engine = Job(tmp_path, checkpoint=False), RanksEngine()

    async def main() -> None:
        job.reports.take(ReportReady(id=1, checkpoint=True))
        await job.step(engine, copies=True)

    asyncio.run(main())
    assert engine.calls == ["resume 1"] and job.reports.copy is None


def test_a_worker_lost_while_the_report_is_written_leaves_the_checkpoint_before(
        tmp_path: Path) -> None:
    job, engine = Job(tmp_path, checkpoint=True), RanksEngine()
    engine.save_error = WorkerLost("rank 1's worker left")

    async def main() -> None:
        job.reports.take(ReportReady(id=4, checkpoint=True))
        assert await job.step(engine) is None

    asyncio.run(main())
    assert [c.split()[0] for c in engine.calls] == ["save", "resume"]
    assert not job.log.checkpoints and not _manifests(tmp_path / "ckpt")


def test_a_hand_over_is_taken_at_the_next_report_with_a_checkpoint(tmp_path: Path) -> None:
    job, engine = Job(tmp_path, checkpoint=True), RanksEngine(step=11, leaving={"tcp://b:1"})

    async def main() -> Any:
        # The ranks pause only at their reports: the regroup waits for the next one.
        assert await job.hand_overs.hand_over(engine, [], manifest=job.manifest) is None
        assert job.hand_overs.awaiting is not None
        job.reports.take(ReportReady(id=6, checkpoint=False))
        assert await job.step(engine) is None  # no state in it: the ranks go on
        job.reports.take(ReportReady(id=7, checkpoint=True))
        return await job.step(engine)

    departure = asyncio.run(main())
    assert departure is not None and departure.workers == ("tcp://b:1",)
    assert departure.roles == ("trainer-1",) and departure.restore.step == 11
    # Written once, as the hand-over's; the ranks stay at the report until the generation ends.
    assert engine.calls == ["resume 6", f"save {Path(departure.restore.directory).name}"]
    assert [c.get("hand_over") for c in job.log.checkpoints] == [True]


def test_the_report_the_ranks_wait_on_at_the_stop_is_the_last_checkpoint(
        tmp_path: Path) -> None:
    job, engine = Job(tmp_path, checkpoint=True), RanksEngine(step=3)
    queued: list[ReportReady | None] = [None, ReportReady(id=5, checkpoint=True), None]
    taken: list[ReportReady | None] = []

    def drain() -> bool:
        if not queued:
            return False
        event = queued.pop(0)
        taken.append(event)
        if event is not None:
            job.reports.take(event)
        return True

    asyncio.run(job.reports.at_finish(engine, drain=drain, manifest=job.manifest))
    assert len(taken) == 2 and queued == [None]  # the events after the report wait for the end
    assert [c.split()[0] for c in engine.calls] == ["save"]  # the stop ends the ranks
    assert [c["step"] for c in job.log.checkpoints] == [3] and job.reports.pending is None


def test_a_forgotten_report_is_not_written_at_the_end(tmp_path: Path) -> None:
    job, engine = Job(tmp_path, checkpoint=True), RanksEngine()
    job.reports.take(ReportReady(id=1, checkpoint=True))
    job.reports.forget()  # its ranks went with their generation
    asyncio.run(job.reports.at_finish(engine, drain=lambda: False, manifest=job.manifest))
    assert engine.calls == [] and not job.log.checkpoints


def test_an_engine_that_schedules_its_checkpoints_has_no_report_at_the_end(
        tmp_path: Path) -> None:
    job = Job(tmp_path, checkpoint=True)
    engine = Ranks()  # no Reporting engine: the controller schedules its checkpoints
    drained: list[int] = []
    asyncio.run(job.reports.at_finish(engine, drain=lambda: bool(drained.append(1)),
                                      manifest=job.manifest))
    assert drained == [] and engine.calls == []
