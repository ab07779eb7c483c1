"""The scorer's schedule: a score every ``score_every`` seconds, within its CPU budget."""

from __future__ import annotations

import random

import pytest

from dask_train.engines.scoring.keeper import ScoreSchedule


def _run(schedule: ScoreSchedule, costs: list[float], *, wall_per_cpu: float = 1.0
         ) -> list[tuple[float, float]]:
    """Score whenever due, each score taking ``cost`` CPU seconds (and ``cost * wall_per_cpu``
    seconds of wall time); the (start, CPU spent before it) of every score."""
    now, seen = schedule.start, []
    for cost in costs:
        now = max(now, schedule.due)
        seen.append((now, schedule.cpu_s))
        schedule.done(cpu_s=cost, started=now)
        now += cost * wall_per_cpu
    return seen


def test_cheap_scores_keep_to_score_every() -> None:
    schedule = ScoreSchedule(every=1.0, budget=0.25, start=100.0)
    starts = [t for t, _ in _run(schedule, [0.01] * 5)]
    assert starts == pytest.approx([101.0, 102.0, 103.0, 104.0, 105.0])
    assert schedule.skipped == 0 and schedule.scores == 5


def test_expensive_scores_are_spaced_out_within_the_budget() -> None:
    rng = random.Random(0)
    costs = [rng.uniform(0.05, 0.4) for _ in range(50)]
    schedule = ScoreSchedule(every=0.1, budget=1 / 3, start=0.0)
    for start, spent_before in _run(schedule, costs):
        # Before every score, the CPU spent so far is within a third of the time run.
        assert spent_before <= start / 3 + 1e-9
    assert schedule.skipped > 0
    # Every due time is either scored or counted as skipped (none is lost track of).
    last = schedule.due - schedule.every
    assert schedule.scores + schedule.skipped == pytest.approx(last / 0.1, abs=1)
    record = schedule.record(now=last)
    assert record["cpu_s"] == pytest.approx(sum(costs))
    assert record["budget"] == pytest.approx(1 / 3) and record["skipped"] == schedule.skipped


def test_without_a_budget_nothing_is_skipped_and_slow_scores_run_back_to_back() -> None:
    schedule = ScoreSchedule(every=0.1, budget=None, start=0.0)
    starts = [t for t, _ in _run(schedule, [0.3] * 4)]
    assert starts == pytest.approx([0.1, 0.4, 0.7, 1.0])  # each as soon as the last ended
    assert schedule.skipped == 0 and schedule.cpu_s == pytest.approx(1.2)
    schedule.spent(0.5)  # the final score: counted, never skipped
    assert schedule.record(now=2.0)["cpu_s"] == pytest.approx(1.7)


def test_a_due_time_with_nothing_new_is_neither_a_score_nor_skipped() -> None:
    schedule = ScoreSchedule(every=0.1, budget=0.5, start=0.0)
    schedule.done(cpu_s=0.01, started=0.1)
    # The trainers waited: the parameters pulled were those scored last, nothing evaluated.
    schedule.done(cpu_s=0.001, started=0.2, scored=False)
    schedule.done(cpu_s=0.01, started=0.3)
    assert (schedule.scores, schedule.unchanged, schedule.skipped) == (2, 1, 0)
    assert schedule.due == pytest.approx(0.4)  # the grid goes on as if it had scored
    record = schedule.record(now=0.4)
    assert record["cpu_s"] == pytest.approx(0.021)  # the pull's CPU is counted all the same
    assert record["unchanged"] == 1 and record["scores"] == 2
