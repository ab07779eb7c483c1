"""Stop conditions: pure policies, tested on plain records without a cluster."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from dask_train.errors import InvalidInput
from dask_train.policy.stop import (
    EarlyStopping,
    StopAfter,
    StopAtScore,
    StopAtStep,
    StopCondition,
    check_stop,
)

NAN = float("nan")


def rec(**values: Any) -> dict[str, Any]:
    """A score record with the controller's keys; the given values override the defaults."""
    base: dict[str, Any] = {
        "time_s": 1.0,
        "step": 10,
        "epoch": 0,
        "samples": 1280,
        "accuracy": 0.5,
        "loss": 1.0,
        "samples_per_s": 1000.0,
    }
    base.update(values)
    return base


def first_firing(cond: StopCondition, records: Sequence[Mapping[str, Any]]) -> int | None:
    """Index of the first record at which ``cond`` fires, or None."""
    for i, record in enumerate(records):
        if cond.should_stop(record, elapsed_s=float(i), step=i):
            return i
    return None


# --- StopAtScore -----------------------------------------------------------------------------


def test_stop_at_score_max_fires_at_threshold_not_before() -> None:
    cond = StopAtScore("accuracy", 0.97)
    records = [rec(accuracy=a) for a in (0.5, 0.9, 0.969, 0.97, 0.99)]
    assert first_firing(cond, records) == 3


def test_stop_at_score_min_fires_at_threshold_not_before() -> None:
    cond = StopAtScore("loss", 0.1)
    records = [rec(loss=v) for v in (2.0, 0.5, 0.11, 0.1)]
    assert cond.mode == "min"
    assert first_firing(cond, records) == 3


@pytest.mark.parametrize(
    ("metric", "mode"),
    [
        ("loss", "min"),
        ("val_loss", "min"),
        ("error_rate", "min"),
        ("MSE_Error", "min"),
        ("accuracy", "max"),
        ("f1", "max"),
    ],
)
def test_stop_at_score_infers_mode_from_name(metric: str, mode: str) -> None:
    assert StopAtScore(metric, 0.5).mode == mode


def test_stop_at_score_explicit_mode_overrides_inference() -> None:
    cond = StopAtScore("loss", 5.0, mode="max")
    assert cond.should_stop(rec(loss=6.0), elapsed_s=0.0, step=0)
    assert not cond.should_stop(rec(loss=1.0), elapsed_s=0.0, step=0)
    assert cond.describe() == "StopAtScore(loss>=5)"


def test_stop_at_score_ignores_ticks_missing_and_nan() -> None:
    cond = StopAtScore("accuracy", 0.0)  # any real accuracy would fire
    assert not cond.should_stop(None, elapsed_s=1e9, step=10**9)
    assert not cond.should_stop({"loss": 0.1, "step": 5}, elapsed_s=1.0, step=5)
    assert not cond.should_stop(rec(accuracy=NAN), elapsed_s=1.0, step=5)
    assert not cond.should_stop(rec(accuracy=None), elapsed_s=1.0, step=5)
    assert cond.should_stop(rec(accuracy=0.0), elapsed_s=1.0, step=5)


def test_stop_at_score_ignores_non_numeric_values() -> None:
    cond = StopAtScore("accuracy", 0.0)
    for bad in ("0.9", True, [0.9]):
        assert not cond.should_stop(rec(accuracy=bad), elapsed_s=0.0, step=0)


def test_stop_at_score_accepts_numpy_scalars() -> None:
    cond = StopAtScore("accuracy", np.float32(0.9))
    assert cond.should_stop(rec(accuracy=np.float64(0.95)), elapsed_s=0.0, step=0)
    assert not cond.should_stop(rec(accuracy=np.float32(0.5)), elapsed_s=0.0, step=0)


def test_stop_at_score_describe_and_repr() -> None:
    cond = StopAtScore("accuracy", 0.97)
    assert cond.describe() == "StopAtScore(accuracy>=0.97)"
    assert repr(cond) == "StopAtScore(accuracy>=0.97)"
    assert StopAtScore("loss", 0.05).describe() == "StopAtScore(loss<=0.05)"
    assert cond.max_step is None
    assert cond.state_dict() == {}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"metric": "", "threshold": 0.5}, r"metric='' is invalid: use a non-empty string"),
        ({"metric": 3, "threshold": 0.5}, r"metric=3 is invalid: use a non-empty string"),
        ({"metric": "acc", "threshold": NAN}, r"threshold=nan is invalid: use a finite number\."),
        ({"metric": "acc", "threshold": math.inf}, r"threshold=inf is invalid"),
        ({"metric": "acc", "threshold": "0.9"}, r"threshold='0\.9' is invalid"),
        ({"metric": "acc", "threshold": True}, r"threshold=True is invalid"),
        (
            {"metric": "acc", "threshold": 0.5, "mode": "up"},
            r"mode='up' is invalid: use 'max', 'min' or None to infer it\.",
        ),
    ],
)
def test_stop_at_score_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        StopAtScore(**kwargs)


def test_stop_at_score_reports_every_problem_at_once() -> None:
    with pytest.raises(InvalidInput) as info:
        StopAtScore("", NAN, mode="biggest")
    assert len(info.value.problems) == 3
    assert "3 problems with the input" in str(info.value)
    assert isinstance(info.value, ValueError)


# --- StopAtStep ------------------------------------------------------------------------------


def test_stop_at_step_fires_on_records_and_ticks() -> None:
    cond = StopAtStep(100)
    assert not cond.should_stop(rec(step=99), elapsed_s=1.0, step=99)
    assert cond.should_stop(rec(step=100), elapsed_s=1.0, step=100)
    assert not cond.should_stop(None, elapsed_s=1.0, step=99)
    assert cond.should_stop(None, elapsed_s=1.0, step=100)
    assert cond.should_stop(None, elapsed_s=1.0, step=150)


def test_stop_at_step_uses_step_argument_not_record() -> None:
    cond = StopAtStep(10)
    # The controller's step argument is authoritative; a record may lag behind it.
    assert cond.should_stop(rec(step=3), elapsed_s=0.0, step=10)


def test_stop_at_step_max_step_and_describe() -> None:
    cond = StopAtStep(100_000)
    assert cond.max_step == 100_000
    assert cond.describe() == "StopAtStep(100000)"
    assert repr(cond) == "StopAtStep(100000)"
    assert StopAtStep(np.int64(5)).max_step == 5


@pytest.mark.parametrize("n", [0, -1, 2.5, 10.0, "10", True, None])
def test_stop_at_step_validation(n: Any) -> None:
    with pytest.raises(InvalidInput, match=r"is invalid: use an integer >= 1\.") as info:
        StopAtStep(n)
    assert info.value.problems == [f"n={n!r} is invalid: use an integer >= 1."]


# --- StopAfter -------------------------------------------------------------------------------


def test_stop_after_fires_at_total_time() -> None:
    cond = StopAfter(30, minutes=1, hours=0.5)
    assert cond.seconds == 30 + 60 + 1800
    assert not cond.should_stop(None, elapsed_s=1889.9, step=0)
    assert cond.should_stop(None, elapsed_s=1890.0, step=0)
    assert cond.should_stop(rec(), elapsed_s=5000.0, step=0)
    assert not cond.should_stop(rec(), elapsed_s=10.0, step=10**9)


@pytest.mark.parametrize(
    ("cond", "text"),
    [
        (StopAfter(300), "StopAfter(300s)"),
        (StopAfter(minutes=5), "StopAfter(300s)"),
        (StopAfter(hours=1), "StopAfter(3600s)"),
        (StopAfter(0.5), "StopAfter(0.5s)"),
        (StopAfter(0, minutes=2), "StopAfter(120s)"),
    ],
)
def test_stop_after_describe(cond: StopAfter, text: str) -> None:
    assert cond.describe() == text
    assert repr(cond) == text
    assert cond.max_step is None


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((), {}, r"StopAfter\(\) is invalid: give seconds, minutes or hours summing to > 0\."),
        ((0,), {}, r"StopAfter\(seconds=0\) is invalid"),
        ((), {"minutes": 0, "hours": 0}, r"StopAfter\(minutes=0, hours=0\) is invalid"),
        ((-1,), {}, r"seconds=-1 is invalid: use a finite number >= 0\."),
        ((), {"minutes": math.inf}, r"minutes=inf is invalid: use a finite number >= 0\."),
        ((), {"hours": NAN}, r"hours=nan is invalid"),
        (("5",), {}, r"seconds='5' is invalid"),
    ],
)
def test_stop_after_validation(args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        StopAfter(*args, **kwargs)


# --- EarlyStopping ---------------------------------------------------------------------------


def test_early_stopping_fires_after_patience_on_plateau() -> None:
    cond = EarlyStopping("loss", patience=3)
    losses = [1.0, 0.8, 0.8, 0.9, 0.85, 0.7]
    records = [rec(loss=v) for v in losses]
    # best 0.8 at index 1; indices 2, 3, 4 do not improve -> fires at 4.
    assert first_firing(cond, records) == 4
    assert cond.best == 0.8
    assert cond.wait == 3


def test_early_stopping_improvement_resets_the_count() -> None:
    cond = EarlyStopping("loss", patience=2)
    losses = [1.0, 1.1, 0.9, 1.0, 0.8, 0.85, 0.86]
    assert first_firing(cond, [rec(loss=v) for v in losses]) == 6


def test_early_stopping_never_fires_on_improving_series() -> None:
    cond = EarlyStopping("loss", patience=1)
    records = [rec(loss=1.0 / (i + 1)) for i in range(50)]
    assert first_firing(cond, records) is None
    assert cond.wait == 0


def test_early_stopping_min_delta_requires_large_enough_gain() -> None:
    cond = EarlyStopping("loss", patience=3, min_delta=0.01)
    # None of the later records beats the best (1.0) by more than 0.01: it fires at the 4th.
    losses = [1.0, 0.995, 0.992, 0.991]
    assert first_firing(cond, [rec(loss=v) for v in losses]) == 3
    assert cond.best == 1.0


def test_early_stopping_min_delta_gain_above_delta_counts() -> None:
    cond = EarlyStopping("loss", patience=2, min_delta=0.01)
    losses = [1.0, 0.98, 0.96, 0.94, 0.92]
    assert first_firing(cond, [rec(loss=v) for v in losses]) is None


def test_early_stopping_max_mode_for_accuracy() -> None:
    cond = EarlyStopping("accuracy", patience=2)
    assert cond.mode == "max"
    accs = [0.5, 0.6, 0.7, 0.69, 0.7, 0.71]
    assert first_firing(cond, [rec(accuracy=a) for a in accs]) == 4


def test_early_stopping_nan_counts_as_no_improvement() -> None:
    cond = EarlyStopping("loss", patience=2)
    assert first_firing(cond, [rec(loss=NAN), rec(loss=NAN)]) == 1
    cond.reset()
    assert first_firing(cond, [rec(loss=1.0), rec(loss=NAN), rec(loss=0.5)]) is None
    assert cond.best == 0.5


def test_early_stopping_ignores_ticks_and_records_without_metric() -> None:
    cond = EarlyStopping("accuracy", patience=1)
    assert not cond.should_stop(rec(accuracy=0.9), elapsed_s=0.0, step=0)
    for _ in range(5):
        assert not cond.should_stop(None, elapsed_s=1e9, step=10**9)
        assert not cond.should_stop({"loss": 1.0}, elapsed_s=1.0, step=1)
    assert cond.wait == 0
    assert cond.should_stop(rec(accuracy=0.8), elapsed_s=2.0, step=2)


def test_early_stopping_stays_fired_until_reset() -> None:
    cond = EarlyStopping("loss", patience=1)
    cond.should_stop(rec(loss=1.0), elapsed_s=0.0, step=0)
    assert cond.should_stop(rec(loss=2.0), elapsed_s=0.0, step=0)
    assert cond.should_stop(None, elapsed_s=0.0, step=0)
    cond.reset()
    assert cond.best is None
    assert cond.wait == 0
    assert not cond.should_stop(None, elapsed_s=0.0, step=0)
    assert not cond.should_stop(rec(loss=2.0), elapsed_s=0.0, step=0)


def test_early_stopping_state_dict_round_trip_restores_behaviour() -> None:
    original = EarlyStopping("loss", patience=3, min_delta=0.001)
    for v in (1.0, 0.5, 0.6, 0.7):
        original.should_stop(rec(loss=v), elapsed_s=0.0, step=0)
    state = json.loads(json.dumps(original.state_dict()))  # must survive a JSON manifest
    assert state == {"best": 0.5, "wait": 2}

    restored = EarlyStopping("loss", patience=3, min_delta=0.001)
    restored.load_state_dict(state)
    fresh = EarlyStopping("loss", patience=3, min_delta=0.001)
    # One more non-improving record stops the restored one, not a fresh one.
    assert restored.should_stop(rec(loss=0.6), elapsed_s=0.0, step=0)
    assert not fresh.should_stop(rec(loss=0.6), elapsed_s=0.0, step=0)


def test_early_stopping_state_dict_before_any_record() -> None:
    cond = EarlyStopping()
    state = cond.state_dict()
    assert json.loads(json.dumps(state)) == {"best": None, "wait": 0}
    other = EarlyStopping()
    other.load_state_dict(state)
    assert other.best is None
    assert other.wait == 0


@pytest.mark.parametrize(
    "state",
    [{"best": "x", "wait": 0}, {"best": NAN, "wait": 0}, {"best": 1.0, "wait": -1}, {"best": 1.0}],
)
def test_early_stopping_load_state_dict_validation(state: dict[str, Any]) -> None:
    cond = EarlyStopping()
    cond.should_stop(rec(loss=0.5), elapsed_s=0.0, step=0)
    with pytest.raises(InvalidInput) as info:
        cond.load_state_dict(state)
    fix = "use state_dict()'s output: 'best' a finite number or None, 'wait' an int >= 0."
    assert info.value.problems == [f"state={state!r} is invalid: {fix}"]
    # A refused state leaves the condition as it was.
    assert cond.state_dict() == {"best": 0.5, "wait": 0}


def test_early_stopping_describe() -> None:
    assert (
        EarlyStopping("loss", patience=3, min_delta=0.001).describe()
        == "EarlyStopping(loss, patience=3, min_delta=0.001)"
    )
    assert repr(EarlyStopping()) == "EarlyStopping(loss, patience=5, min_delta=0)"
    assert (
        EarlyStopping("accuracy", patience=2, mode="min").describe()
        == "EarlyStopping(accuracy, patience=2, min_delta=0, mode=min)"
    )
    # An explicit mode equal to the inferred one is not repeated.
    assert EarlyStopping("loss", mode="min").describe() == "EarlyStopping(loss, patience=5, min_delta=0)"
    assert EarlyStopping().max_step is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"patience": 0}, r"patience=0 is invalid: use an integer >= 1\."),
        ({"patience": 2.0}, r"patience=2\.0 is invalid"),
        ({"patience": True}, r"patience=True is invalid"),
        ({"min_delta": -0.1}, r"min_delta=-0\.1 is invalid: use a finite number >= 0\."),
        ({"min_delta": math.inf}, r"min_delta=inf is invalid"),
        ({"metric": ""}, r"metric='' is invalid: use a non-empty string"),
        ({"mode": "MAX"}, r"mode='MAX' is invalid: use 'max', 'min' or None"),
    ],
)
def test_early_stopping_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        EarlyStopping(**kwargs)


def test_early_stopping_reports_every_problem_at_once() -> None:
    with pytest.raises(InvalidInput) as info:
        EarlyStopping(metric="", patience=0, min_delta=-1.0, mode="best")
    assert len(info.value.problems) == 4


# --- check_stop and the base class -----------------------------------------------------------


def test_check_stop_returns_first_firing_in_order() -> None:
    by_step, by_time = StopAtStep(10), StopAfter(5)
    assert check_stop([by_step, by_time], None, elapsed_s=6.0, step=10) is by_step
    assert check_stop([by_time, by_step], None, elapsed_s=6.0, step=10) is by_time
    assert check_stop([by_step, by_time], None, elapsed_s=6.0, step=1) is by_time
    assert check_stop([by_step, by_time], None, elapsed_s=1.0, step=1) is None
    assert check_stop([], rec(), elapsed_s=1.0, step=1) is None


def test_check_stop_asks_every_condition_even_after_one_fires() -> None:
    early = EarlyStopping("loss", patience=5)
    fired = check_stop([StopAtStep(1), early], rec(loss=0.3), elapsed_s=0.0, step=1)
    assert isinstance(fired, StopAtStep)
    assert early.best == 0.3


def test_custom_condition_defaults() -> None:
    class EveryOther(StopCondition):
        def should_stop(self, record: Mapping[str, Any] | None, *, elapsed_s: float, step: int) -> bool:
            return step % 2 == 1

        def describe(self) -> str:
            return "EveryOther()"

    cond = EveryOther()
    assert repr(cond) == "EveryOther()"
    assert cond.max_step is None
    assert cond.state_dict() == {}
    cond.load_state_dict({})
    cond.reset()
    assert check_stop([cond], None, elapsed_s=0.0, step=3) is cond


def test_stop_condition_is_abstract() -> None:
    with pytest.raises(TypeError):
        StopCondition()  # type: ignore[abstract]
