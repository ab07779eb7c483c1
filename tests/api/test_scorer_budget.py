"""The scorer keeps to its share of the CPU: a slow metric spaces the scores out instead of
slowing the trainers, and the result and the scorer's stats say what it spent."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt

#: CPU seconds the slow metric burns on the scorer's thread per score.
COST_S = 0.1


def slow_accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    """Accuracy, after burning ``COST_S`` of this thread's CPU (a metric that is costly)."""
    start = time.thread_time()
    while time.thread_time() - start < COST_S:
        pass
    return float((output.argmax(1) == target).float().mean())


class ScorerStats(dt.Callback):
    """Keeps the scorer's once-a-second reports."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    def on_stats(self, stats: Mapping[str, Any]) -> None:
        if stats.get("role") == "scorer":
            self.reports.append(dict(stats))


def test_a_slow_metric_is_scored_less_often_within_the_scorers_budget(client: Client) -> None:
    X, y = dt.datasets.digits(24_000, seed=0, chunks=2_000)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    stats = ScorerStats()
    # 0.05 s between scores asked, 0.1 CPU-s a score: ten times what a third of a core allows.
    result = dt.Trainer(net, workers=2, ps=1, batch_size=64, epochs=3, score_every=0.05,
                        metrics={"slow": slow_accuracy}, callbacks=[stats], progress=False,
                        client=client).fit(X, y, validation=dt.datasets.digits_test())
    scorer = result.scorer
    assert scorer["budget"] == pytest.approx(1 / 3)  # "auto": 1 / (2 trainers + 1)
    # Scored less often than asked: every 0.05 s asks for a score, and at 0.1 CPU-s each a
    # third of a core allows at most one in six (plus the first). How many asks the scorer saw
    # and skipped depends on how often its loop ran: a loaded machine ran it less (7 scores, 5
    # skipped, with another suite beside); it skipped some, however loaded.
    asked = scorer["wall_s"] / 0.05
    assert scorer["scores"] >= 1 and scorer["skipped"] >= 1
    assert scorer["scores"] <= asked / 3, (scorer, asked)
    # Its CPU is measured: every score burned COST_S, the final one included.
    assert scorer["cpu_s"] >= COST_S * (scorer["scores"] + 1) - 1e-6
    # Within the budget: before each score the CPU spent was at most a third of the time run,
    # so in all at most that plus the last periodic score and the final one.
    assert scorer["cpu_s"] <= scorer["budget"] * scorer["wall_s"] + 2 * (COST_S + 0.05)
    assert scorer["share"] == pytest.approx(scorer["cpu_s"] / result.wall_s, abs=1e-3)
    assert len(result.history) >= scorer["scores"]  # each score a history row (and the final)
    assert np.isfinite(result.history["slow"]).all()
    # The scorer's stats say the same as it goes.
    assert stats.reports, "the scorer published no stats"
    last = stats.reports[-1]
    assert last["cpu_s_total"] > 0 and last["skipped_total"] >= 0 and last["interval_s"] > 0


def test_no_budget_scores_every_time_and_bad_budgets_are_named(client: Client) -> None:
    X, y = dt.datasets.digits(4_000, seed=0, chunks=1_000)
    net = torch.nn.Sequential(torch.nn.Linear(64, 10))
    result = dt.Trainer(net, workers=1, ps=1, batch_size=64, epochs=2, score_every=0.05,
                        scorer_budget=None, progress=False,
                        client=client).fit(X, y, validation=dt.datasets.digits_test())
    assert result.scorer["budget"] is None and result.scorer["skipped"] == 0
    for bad in (0, -1.0, True, "half"):
        with pytest.raises(dt.InvalidInput) as info:
            dt.Trainer(net, scorer_budget=bad, progress=False, client=client).fit(X, y)
        assert f"scorer_budget={bad!r} is invalid: use 'auto'" in str(info.value)
