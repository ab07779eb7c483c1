"""The failure policy as a table: job status after a loss -> CONTINUE, REPLACE, RESTART or RAISE."""

from __future__ import annotations

import pytest

from dask_train.errors import InvalidInput, ParameterServerLost, WorkerLost
from dask_train.policy._failure import (
    Action,
    Decision,
    Failure,
    FailureConfig,
    JobStatus,
    decide,
    failure_error,
)

ADDR = "tcp://10.1.2.3:40001"
C, RP, RS, X = Action.CONTINUE, Action.REPLACE, Action.RESTART, Action.RAISE


# What each engine says it can do, as the controller passes it (the engines' flags): async-ps
# trainers go on alone, dt.run's ranks report their state, sync ranks hold it.
INDEPENDENT = {"async-ps"}
REPORTS = {"run"}
HOLD = {"sync", "run"}


def _status(strategy: str = "async-ps", kind: str = "trainer", *, failures: int = 1, live_trainers: int = 2,
            live_workers: int = 3, has_checkpoint: bool = True, index: int = 0,
            survivors_hold_state: bool = False) -> JobStatus:
    return JobStatus(strategy, Failure(kind, index, ADDR, "removed from the scheduler"), failures,
                     live_trainers, live_workers, has_checkpoint,
                     survivors_hold_state=survivors_hold_state,
                     independent_trainers=strategy in INDEPENDENT, reports_state=strategy in REPORTS)


TABLE = [
    # strategy, kind, failures, live_trainers, live_workers, has_checkpoint -> action, words in reason
    ("async-ps", "trainer", 1, 2, 3, True, C, "2 trainer(s) go on"),
    ("async-ps", "trainer", 1, 1, 1, False, C, "trainer-0 had not consumed"),
    ("async-ps", "trainer", 3, 1, 1, False, C, ""),  # the last allowed failure
    ("async-ps", "trainer", 1, 0, 2, True, RS, "no trainer is left"),
    ("async-ps", "trainer", 1, 0, 2, False, RS, "starts again from the initial parameters"),
    ("async-ps", "ps", 1, 2, 3, True, RS, "new generation restarts from the last checkpoint"),
    ("async-ps", "ps", 1, 2, 3, False, RS, "no checkpoint was written yet"),
    ("async-ps", "scorer", 1, 2, 3, False, RP, "started on another worker"),
    ("async-ps", "scorer", 1, 0, 1, True, RP, ""),
    ("sync", "trainer", 1, 1, 3, True, RS, "sync group needs every rank"),
    ("sync", "trainer", 1, 3, 3, True, RS, ""),  # a sync rank never lets the group go on alone
    ("sync", "trainer", 1, 1, 3, False, RS, "samples trained so far are trained again"),
    ("sync", "scorer", 2, 2, 2, False, RP, ""),
    ("full-batch", "trainer", 1, 3, 3, True, RS, "full-batch group needs every rank"),
    ("run", "trainer", 1, 1, 3, True, RS, "dt.run job's ranks form one process group"),
    # beyond max_failures=3: always raise, whatever else holds
    ("async-ps", "trainer", 4, 5, 5, True, X, "failure 4 is more than max_failures=3"),
    ("async-ps", "scorer", 4, 5, 5, True, X, "max_failures=3"),
    ("async-ps", "ps", 4, 5, 5, True, X, "max_failures=3"),
    ("sync", "trainer", 4, 5, 5, True, X, "max_failures=3"),
    # no live worker at all: raise, whatever else holds
    ("async-ps", "trainer", 1, 1, 0, True, X, "resume=True"),
    ("async-ps", "scorer", 1, 1, 0, True, X, "no Dask worker is alive"),
    ("sync", "trainer", 1, 0, 0, False, X, "no Dask worker is alive"),
]


@pytest.mark.parametrize(
    ("strategy", "kind", "failures", "live_trainers", "live_workers", "has_checkpoint", "action", "words"),
    TABLE,
)
def test_decide(strategy: str, kind: str, failures: int, live_trainers: int, live_workers: int,
                has_checkpoint: bool, action: Action, words: str) -> None:
    status = _status(strategy, kind, failures=failures, live_trainers=live_trainers,
                     live_workers=live_workers, has_checkpoint=has_checkpoint)
    decision = decide(status, FailureConfig(max_failures=3))
    assert decision.action is action
    assert words in decision.reason


@pytest.mark.parametrize("max_failures", [0, 1, 5])
def test_max_failures_is_the_last_survived(max_failures: int) -> None:
    config = FailureConfig(max_failures=max_failures)
    if max_failures:
        assert decide(_status(failures=max_failures), config).action is Action.CONTINUE
    assert decide(_status(failures=max_failures + 1), config).action is Action.RAISE


@pytest.mark.parametrize("value", [-1, 1.5, True, None, "3"])
def test_failure_config_rejects(value: object) -> None:
    with pytest.raises(InvalidInput, match=rf"FailureConfig\(max_failures={value!r}\): max_failures must be"):
        FailureConfig(max_failures=value)  # type: ignore[arg-type]


def test_records_reject_bad_values() -> None:
    with pytest.raises(InvalidInput, match="kind must be one of"):
        Failure("chief", 0, ADDR, "x")
    # The seed's name for a trainer is read as "trainer".
    assert Failure("worker", 1, ADDR, "x").role == "trainer-1"
    with pytest.raises(InvalidInput, match="index must be an integer >= 0"):
        Failure("ps", -1, ADDR, "x")
    with pytest.raises(InvalidInput) as info:
        JobStatus("sync", Failure("ps", 0, ADDR, "x"), 0, -1, -1, True)
    assert len(info.value.problems) == 3


def test_failure_error_for_a_parameter_server() -> None:
    status = _status(kind="ps", index=1, failures=2, has_checkpoint=False)
    decision = decide(status, FailureConfig(max_failures=1))
    err = failure_error(status, decision)
    assert type(err) is ParameterServerLost
    assert isinstance(err, WorkerLost) and isinstance(err, RuntimeError)
    assert (err.worker, err.role) == (ADDR, "ps-1")
    message = str(err)
    for words in ("ps-1", ADDR, "removed from the scheduler", "failure 2",
                  "is more than max_failures=1", "FailureConfig(max_failures=...)"):
        assert words in message


@pytest.mark.parametrize("kind", ["trainer", "scorer"])
def test_failure_error_for_other_roles(kind: str) -> None:
    status = _status(kind=kind, index=2, failures=4)
    err = failure_error(status, decide(status, FailureConfig(max_failures=3)))
    assert type(err) is WorkerLost
    assert err.role == f"{kind}-2"
    assert "failure 4 is more than max_failures=3" in str(err)
    assert "FailureConfig(max_failures=...)" in str(err)


def test_decision_is_a_plain_record() -> None:
    decision = decide(_status(kind="scorer"), FailureConfig())
    assert decision == Decision(Action.REPLACE, decision.reason)
    assert Action("restart") is Action.RESTART


SURVIVORS = [
    # strategy, kind, live_trainers, has_checkpoint -> words in the reason
    ("sync", "trainer", 1, True, "the last step all applied (from the last checkpoint if"),
    ("sync", "trainer", 2, False, "(from the initial parameters if"),
    ("run", "trainer", 1, False, "state the surviving ranks hold at its last report"),
]


@pytest.mark.parametrize(("strategy", "kind", "live_trainers", "has_checkpoint", "words"), SURVIVORS)
def test_restart_from_the_survivors(strategy: str, kind: str, live_trainers: int, has_checkpoint: bool,
                                    words: str) -> None:
    status = _status(strategy, kind, live_trainers=live_trainers, has_checkpoint=has_checkpoint,
                     survivors_hold_state=strategy in HOLD)
    decision = decide(status, FailureConfig())
    assert decision.action is Action.RESTART
    assert "a new generation goes on from the state the surviving ranks hold" in decision.reason
    assert words in decision.reason


@pytest.mark.parametrize(("kind", "live_trainers"), [("ps", 2), ("trainer", 0)])
def test_no_survivors_state_without_a_surviving_rank_or_after_a_server(kind: str, live_trainers: int) -> None:
    # A lost server's shard is no rank's to give; with no rank left, none holds anything.
    status = _status("sync", kind, live_trainers=live_trainers, survivors_hold_state=True)
    decision = decide(status, FailureConfig())
    assert decision.action is Action.RESTART
    assert "surviving ranks" not in decision.reason


def test_the_capabilities_decide_not_the_name() -> None:
    lost = Failure("trainer", 0, ADDR, "removed from the scheduler")
    alone = JobStatus("custom", lost, 1, 2, 3, True, independent_trainers=True)
    assert decide(alone, FailureConfig()).action is Action.CONTINUE
    grouped = JobStatus("async-ps", lost, 1, 2, 3, True)
    decision = decide(grouped, FailureConfig())
    assert decision.action is Action.RESTART and "async-ps group needs every rank" in decision.reason
    reporting = JobStatus("custom", lost, 1, 2, 3, True, reports_state=True)
    assert "dt.run job's ranks form one process group" in decide(reporting, FailureConfig()).reason
