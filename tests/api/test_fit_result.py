"""What a fit reports about itself: phase timings, the clock's origin, the global batch."""

from __future__ import annotations

import time

import pytest
import torch
from distributed import Client

import dask_train as dt


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def test_timings_cover_the_whole_fit_phase_by_phase(client: Client) -> None:
    X, y = dt.datasets.digits(8_000, seed=0, chunks=1_000)
    before = time.time()
    result = dt.Trainer(_mlp(), lr=3e-3, batch_size=64, epochs=1, score_every=0.2,
                        progress=False, client=client).fit(X, y, validation=dt.datasets.digits_test())
    after = time.time()
    t = result.timings
    assert set(t) == {"connect", "persist", "roles", "first_step", "train", "teardown", "total"}
    assert t["connect"] == 0.0  # the client was given
    assert all(v >= 0 for v in t.values()) and t["persist"] > 0 and t["train"] > 0
    assert t["total"] <= after - before + 1e-6
    # The phases are consecutive pieces of the fit, each counted once.
    assert sum(v for k, v in t.items() if k != "total") <= t["total"] + 1e-3
    # history.time_s counts from started_at: the roles' start, after the data was persisted.
    assert before <= result.started_at <= after
    last = result.history["time_s"].iloc[-1]
    assert last <= t["roles"] + t["first_step"] + t["train"] + t["teardown"] + 1e-3


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_global_batch_size_splits_over_the_trainers(client: Client, strategy: str) -> None:
    X, y = dt.datasets.digits(8_000, seed=0, chunks=1_000)  # 8 blocks of 1,000 rows
    result = dt.Trainer(_mlp(), strategy=strategy, workers=2, global_batch_size=128, epochs=1,
                        scorer=0, shuffle=False, progress=False, client=client).fit(X, y)
    # 64 rows per trainer: a block of 1,000 rows is 16 batches (15 of 64 and one of 40).
    if strategy == "async-ps":
        assert result.steps == 8 * 16  # one server update per trainer batch
    else:
        # Each step takes one batch of 64 from each rank: as many steps as the rank with the most
        # blocks has batches (4 and 4 blocks: 64 steps; 5 and 3, where Dask placed them so in a
        # full run: 80).
        blocks = result.ledger.groupby("trainer")["block"].nunique()
        assert blocks.sum() == 8 and result.steps == 16 * int(blocks.max())


def test_global_batch_size_problems_name_the_fix(client: Client) -> None:
    X, y = dt.datasets.digits(2_000, seed=0)
    with pytest.raises(dt.InvalidInput) as info:
        dt.Trainer(_mlp(), workers=3, global_batch_size=128, batch_size=32, client=client).fit(X, y)
    message = str(info.value)
    assert "are both given" in message and "use a multiple of 3, e.g. 126" in message
