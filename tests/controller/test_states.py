"""The controller's states (``controller/_states.py``), without a cluster.

The moves each state's ``step`` can make (its return annotation) are checked against the one
table of legal moves, ``_state._NEXT``; then the states are driven over a scripted job: the
controller's side of them (the ``Job`` protocol), whose parts and methods record their calls
and return what a test sets. The real controller over them is test_phases.py's.
"""

from __future__ import annotations

import asyncio
import typing
from typing import Any

import numpy as np
import pytest
from _fake_engine import FakeEngine, _spec  # noqa: E402

from dask_train.controller import _states
from dask_train.controller._hook_thread import CallbackThread
from dask_train.controller._state import _NEXT, JobLog, JobState, Phase
from dask_train.controller._states import (
    Errored,
    Finished,
    Finishing,
    HandingOver,
    Outcome,
    Restarting,
    Running,
    Starting,
    State,
)
from dask_train.engines._protocol import Ending
from dask_train.errors import NonFiniteLoss
from dask_train.policy._failure import Failure
from dask_train.policy._placement import Roles

STATES = [Starting, Running, Restarting, HandingOver, Finishing, Finished, Errored]


def _successors(cls: type[State]) -> set[type[State]]:
    """The states ``cls.step`` can return, read from its annotation."""
    ret = typing.get_type_hints(cls.step, {**vars(_states), **globals()})["return"]
    return set(typing.get_args(ret)) or {ret}


def _moves(classes: list[type[State]]) -> tuple[set[tuple[Phase, Phase]], list[str]]:
    """The phase moves the states of ``classes`` make, and those of them ``_NEXT`` refuses."""
    made: set[tuple[Phase, Phase]] = set()
    refused: list[str] = []
    for cls in classes:
        for phase in cls.phases:
            for nxt in [] if cls.terminal else sorted(_successors(cls), key=str):
                # The move into a state enters its first phase.
                made.add((phase, nxt.phases[0]))
                if nxt.phases[0] not in _NEXT[phase]:
                    refused.append(f"{cls.__name__} ({phase.value}) -> {nxt.__name__}")
        # Within a state (a checkpoint's pause inside a generation's loop).
        made |= {(a, b) for a in cls.phases for b in cls.phases if a is not b}
    return made, refused


def test_every_state_is_a_state_of_the_module_and_every_phase_has_one() -> None:
    found = {obj for obj in vars(_states).values()
             if isinstance(obj, type) and issubclass(obj, State) and obj is not State}
    assert found == set(STATES)
    assert {p for cls in STATES for p in cls.phases} == set(Phase)
    for cls in STATES:
        if cls.terminal:  # no step: the controller returns its outcome or raises its error
            assert cls.step is State.step and all(not _NEXT[p] for p in cls.phases)
        else:
            assert cls.step is not State.step and _successors(cls) <= set(STATES), cls


def test_every_move_a_state_makes_is_one_the_next_table_allows_and_no_other() -> None:
    made, refused = _moves(STATES)
    assert refused == []
    # _NEXT lists no move that no state makes.
    assert made == {(a, b) for a, nexts in _NEXT.items() for b in nexts}


class _SkipsItsFinish(State):
    """A state that would finish a job from its start, which no phase table allows."""

    phases = (Phase.STARTING,)

    async def step(self, job: Any) -> Running | Finished:
        raise NotImplementedError


def test_a_state_whose_step_could_make_a_move_the_table_refuses_is_found() -> None:
    made, refused = _moves([_SkipsItsFinish])
    assert made == {(Phase.STARTING, Phase.RUNNING), (Phase.STARTING, Phase.FINISHED)}
    assert refused == ["_SkipsItsFinish (starting) -> Finished"]


# -- the states driven over a scripted job ------------------------------------------------------
class Published:
    """The job's events as the states publish them (the real publisher needs a scheduler)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    def publish(self, msg: dict[str, Any]) -> None:
        self.messages.append(dict(msg))

    async def end(self, **fields: Any) -> None:
        self.publish({"kind": "end", **fields})


class ScriptedHistory:
    """The job's ``history``, scripted: each of a pass's calls is recorded."""

    def __init__(self, job: ScriptedJob) -> None:
        self.job = job

    async def take_event(self) -> None:
        self.job._do("events")

    def callback_stop(self) -> None:
        self.job._do("stops")

    def check_time(self, now: float) -> None:
        self.job._do("time")

    def trainers_ended(self, engine: FakeEngine) -> None:
        self.job._do("trainers ended")

    def untrained(self, ending: Ending) -> NonFiniteLoss | None:
        return self.job.untrained


class ScriptedKeeper:
    """The job's ``keeper``, scripted: a pass's checkpoint work is recorded."""

    def __init__(self, job: ScriptedJob) -> None:
        self.job = job

    copies = None

    async def step(self, engine: FakeEngine, now: float) -> None:
        self.job._do("checkpoint")

    def manifest(self, ledger: dict[str, Any], rng: Any) -> dict[str, Any]:
        return {}

    def mark_copied(self) -> None:
        pass


class ScriptedReports:
    """The job's ``reports``, scripted: a pass's look at a ``dt.run`` report is recorded."""

    def __init__(self, job: ScriptedJob) -> None:
        self.job = job

    async def step(self, engine: FakeEngine, **per_call: Any) -> None:
        self.job._do("report")


class ScriptedEngine(FakeEngine):
    """A generation's engine whose tick (its periodic work) is recorded in the job's calls."""

    def __init__(self, job: ScriptedJob) -> None:
        super().__init__()
        self.job = job
        self.roles = Roles({"trainer": ["w"]})

    async def tick(self, now: float) -> str:
        self.job._do("tick")
        return ""


class ScriptedLiveness:
    """The job's ``liveness``, scripted: its looks at the roles return ``job.lost`` in turn."""

    def __init__(self, job: ScriptedJob) -> None:
        self.job = job

    async def hand_over(self, engine: FakeEngine) -> None:
        self.job._do("hand-over")

    async def check(self, engine: FakeEngine) -> Any:
        return self.job._do("liveness", self.job.lost)


class ScriptedRestarts:
    """The job's ``restarts``, scripted: each enters RESTARTING, then the next generation's
    STARTING, as :class:`~dask_train.controller._restarts.Restarts` does."""

    def __init__(self, job: ScriptedJob) -> None:
        self.job = job

    async def after_loss(self, engine: FakeEngine, failure: Failure) -> None:
        self.job.state.enter(Phase.RESTARTING)
        self.job._do("restart")
        self.job.state.enter(Phase.STARTING)

    async def after_departure(self, engine: FakeEngine, departure: Any) -> None:
        self.job.state.enter(Phase.RESTARTING)
        self.job._do("hand over restart")
        self.job.state.enter(Phase.STARTING)


class ScriptedJob:
    """The ``Job`` protocol, scripted. ``starts``, ``finishes`` and ``lost`` are what successive
    ``start``, ``finish`` and ``liveness.check`` calls return (an exception is raised). What enters a
    phase itself in the controller (``finish``, the restarts) enters it here too."""

    def __init__(self, *, starts: list[Any] | None = None, finishes: list[Any] | None = None,
                 lost: list[Any] | None = None, stop_on: str = "stops",
                 untrained: NonFiniteLoss | None = None,
                 make_error: BaseException | None = None) -> None:
        self.state, self.log, self.spec = JobState(), JobLog(), _spec()
        self.callbacks = CallbackThread([])
        self.publisher = Published()
        self.starts, self.finishes, self.lost = starts or [], finishes or [], lost or []
        self.stop_on, self.untrained, self.make_error = stop_on, untrained, make_error
        self.calls: list[str] = []
        self.engines: list[FakeEngine] = []
        self.history, self.keeper = ScriptedHistory(self), ScriptedKeeper(self)
        self.reports = ScriptedReports(self)
        self.liveness, self.restarts = ScriptedLiveness(self), ScriptedRestarts(self)

    def _do(self, name: str, script: list[Any] | None = None) -> Any:
        self.calls.append(name)
        if name == self.stop_on and not script:  # a stop once the script, if any, is spent
            self.state.stop(name)
        result = script.pop(0) if script else None
        if isinstance(result, BaseException):
            raise result
        return result

    async def new_engine(self) -> FakeEngine:
        if self.make_error is not None:
            raise self.make_error
        engine = ScriptedEngine(self)
        self.engines.append(engine)
        return engine

    async def start(self, engine: FakeEngine) -> Failure | None:
        return self._do("start", self.starts)

    async def finish(self, engine: FakeEngine) -> Any:
        self.state.enter(Phase.FINISHING)
        return self._do("finish", self.finishes)


S, R, C, RS, F, FD, E = (Phase.STARTING, Phase.RUNNING, Phase.CHECKPOINTING, Phase.RESTARTING,
                         Phase.FINISHING, Phase.FINISHED, Phase.ERRORED)
LOST = Failure(kind="trainer", index=0, worker="w", cause="removed from the scheduler")
ENDING = Ending(params=np.zeros(2), steps=3, samples=30, trainers=[])


def _drive(job: ScriptedJob) -> list[State]:
    """The states the job goes through, as the controller runs them, the last one included."""

    async def main() -> list[State]:
        seen: list[State] = [Starting()]
        while not seen[-1].terminal:
            seen.append(await seen[-1].step(job))
        return seen

    return asyncio.run(main())


def test_a_pass_runs_its_concerns_in_order_and_looks_at_the_roles_when_due() -> None:
    job = ScriptedJob(stop_on="")
    job.state.enter(Phase.RUNNING)
    running = Running(ScriptedEngine(job))

    async def passes() -> None:
        assert await running.one_pass(job) is None
        running.next_liveness = float("inf")  # looked at the roles a moment ago
        assert await running.one_pass(job) is None
        job.state.enter(Phase.CHECKPOINTING)  # no hand-over starts in a checkpoint's pause
        assert await running.one_pass(job) is None

    asyncio.run(passes())
    work = ["events", "stops", "time", "tick", "checkpoint", "report"]
    assert job.calls == [*work, "hand-over", "liveness", *work, "hand-over", *work]


@pytest.mark.parametrize(("stop_on", "calls"), [
    # A callback's stop: nothing of the generation's work is asked for any more.
    ("stops", ["events", "stops", "liveness"]),
    # A time limit decided in this pass: its engine work goes on, no hand-over starts.
    ("time", ["events", "stops", "time", "tick", "checkpoint", "report", "liveness"]),
])
def test_a_stop_decided_in_a_pass_leaves_out_the_work_after_it(stop_on: str,
                                                               calls: list[str]) -> None:
    job = ScriptedJob(stop_on=stop_on)
    job.state.enter(Phase.RUNNING)
    asyncio.run(Running(ScriptedEngine(job)).one_pass(job))
    assert job.calls == calls


def test_a_start_that_lost_a_role_restarts_then_the_next_generation_runs_and_finishes() -> None:
    job = ScriptedJob(starts=[LOST, None], finishes=[ENDING])
    seen = _drive(job)

    assert [type(s) for s in seen] == [Starting, Restarting, Starting, Running, Finishing,
                                       Finished]
    assert [*job.state.history, job.state.phase] == [S, RS, S, R, F, FD]
    assert job.calls == ["start", "restart", "start", "events", "stops", "liveness", "finish"]
    first, second = job.engines
    assert first.calls == [] and second.calls == ["close"]  # the restarts close their own (not here)
    last = seen[-1]
    assert isinstance(last, Finished) and last.outcome.ending is ENDING
    assert last.outcome.stopped_by == "stops"
    assert job.log.roles_up_at is not None
    assert job.publisher.messages == [{"kind": "end", "stopped_by": "stops"}]


def test_a_role_lost_while_running_or_finishing_restarts_and_a_departure_hands_over() -> None:
    seen = _drive(ScriptedJob(finishes=[LOST, ENDING]))
    assert [type(s) for s in seen] == [Starting, Running, Finishing, Restarting, Starting,
                                       Running, Finishing, Finished]

    departure = object()  # what the states carry to the restarts, untouched
    # The third look at the roles finds nothing, and stops the job.
    job = ScriptedJob(lost=[LOST, departure], finishes=[ENDING], stop_on="liveness")
    seen = _drive(job)
    assert [type(s) for s in seen] == [Starting, Running, Restarting, Starting, Running,
                                       HandingOver, Starting, Running, Finishing, Finished]
    handing = seen[5]
    assert isinstance(handing, HandingOver) and handing.departure is departure
    assert [*job.state.history, job.state.phase] == [S, R, RS, S, R, RS, S, R, F, FD]


@pytest.mark.parametrize("error", [RuntimeError("boom"), asyncio.CancelledError()])
@pytest.mark.parametrize("where", ["start", "finish"])
def test_an_error_in_a_step_errors_with_the_end_published_and_the_engine_closed(
        error: BaseException, where: str) -> None:
    job = ScriptedJob(starts=[error] if where == "start" else [],
                      finishes=[error] if where == "finish" else [])
    seen = _drive(job)

    last = seen[-1]
    assert isinstance(last, Errored) and last.error is error
    assert job.state.phase is E
    said = "interrupted (Ctrl-C)" if isinstance(error, asyncio.CancelledError) else \
        "RuntimeError: boom"
    assert job.publisher.messages == [{"kind": "end", "error": said}]
    assert job.engines[0].calls == ["close"]


def test_an_error_making_a_generations_engine_is_raised_as_it_is() -> None:
    job = ScriptedJob(make_error=ValueError("no engine"))
    with pytest.raises(ValueError, match="no engine"):
        _drive(job)
    assert job.state.phase is S and job.publisher.messages == []


def test_a_job_that_trained_nothing_errors_once_its_engine_is_closed_and_closes_it_once() -> None:
    error = NonFiniteLoss("no finite step", step=0, trainer="trainer-0", block=-1, epoch=-1,
                          loss="nan")
    job = ScriptedJob(finishes=[ENDING], untrained=error)
    seen = _drive(job)

    last = seen[-1]
    assert isinstance(last, Errored) and last.error is error
    assert [*job.state.history, job.state.phase] == [S, R, F, E]
    assert job.engines[0].calls == ["close"]
    assert job.publisher.messages == [{"kind": "end", "error": "NonFiniteLoss: no finite step"}]


def test_an_outcome_names_the_stopping_scores_step_only_when_its_parameters_were_kept() -> None:
    state, log = JobState(), JobLog()
    state.stop("score")
    state.stop_step = 2
    engine = FakeEngine()
    engine.roles = Roles({"trainer": ["w"]})
    kept = Ending(params=np.ones(2), steps=3, samples=30, trainers=[],
                  final={"record": None, "params": np.ones(2)})

    outcome = Outcome.of(engine, kept, log=log, state=state)
    assert (outcome.model_step, outcome.stopped_by, outcome.roles) == (2, "score", engine.roles)
    assert outcome.ledger == engine.ledger_records() and outcome.log is log
    assert Outcome.of(engine, ENDING, log=log, state=state).model_step == 3  # the last ones
