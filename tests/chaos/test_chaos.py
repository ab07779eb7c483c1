"""Chaos: a job in each strategy (a ``dt.run`` loop too), and a search, during which a seeded
schedule SIGKILLs three workers at random moments (a trainer's, a parameter server's, the
scorer's, a rank's, a search trial's); the nannies restart them. In a job, one of the three is
retired instead (as a scale-down does: the job hands its roles over), and the cluster is scaled
back (a new worker joins). Each job still reaches the accuracy of the same training in plain
torch (less a margin for async staleness) and applies every sample of every epoch exactly once
(its ledger, and the servers' count).

The moments are shares of the work, not seconds: a loaded machine makes the job slower, not the
kills later than its end. ``_faults.Schedule`` draws them, the victims' kinds and the delays from
``random.Random(SEED)``; a failure prints the kills it made.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt

sys.path.insert(0, str(Path(__file__).parents[1] / "engines"))
sys.path.insert(0, str(Path(__file__).parent))
from _faults import (  # noqa: E402
    JobWatch,
    Schedule,
    killable_cluster,
    running_trainers,
    summary,
)
from _models import Slow  # noqa: E402

SEED = 24
# Epochs enough for three kills: each waits for the nanny's new worker and a score after the
# one before, and with 12 the job (faster now) had trained to its end before the third once.
ROWS, EPOCHS, BATCH = 8_000, 30, 32
# Seconds each training batch of 32 first sleeps (not CPU), a dt.run batch of 64 twice that: on a
# quarter of the rows the jobs last a little longer than 32,000 rows an epoch did at full speed
# (27-41 s against 19-24 s, run alone: time for the three kills, their restarts and scores). The
# file took 68 CPU s, not 138.
PACE = 0.005


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    # Its own cluster: these tests kill its workers.
    with killable_cluster() as client:
        yield client


@pytest.fixture(autouse=True)
def _whole_cluster(client: Client) -> None:
    # Before each test, not after: the last test's victims need not come back to be closed.
    client.wait_for_workers(2, timeout=60)  # the nanny brings the last victim back


def _arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    # Three classes from a fixed linear map of eight features.
    x = np.random.default_rng(seed).normal(size=(n, 8)).astype(np.float32)
    return x, (x @ np.random.default_rng(0).normal(size=(8, 3))).argmax(axis=1)


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


@pytest.fixture(scope="module")
def data() -> dict[str, object]:
    """The training data, held-out data, and what plain torch reaches on them in one epoch."""
    x, y = _arrays(ROWS, seed=1)
    xv, yv = _arrays(4000, seed=2)
    torch.manual_seed(0)
    # One thread: two of a loaded 2-core machine made the thousand steps 15 times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    net, X, Y = _net(), torch.from_numpy(x), torch.from_numpy(y)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    for i in range(0, ROWS, BATCH):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(X[i:i + BATCH]), Y[i:i + BATCH]).backward()
        optimizer.step()
    with torch.no_grad():
        reference = float((net(torch.from_numpy(xv)).argmax(1).numpy() == yv).mean())
    torch.set_num_threads(threads)
    return {"X": da.from_array(x, chunks=(1000, 8)), "y": da.from_array(y, chunks=1000),
            "validation": (xv, yv), "reference": reference}


def _trainer(client: Client, strategy: str, **kw: object) -> dt.Trainer:
    options: dict[str, object] = dict(
        strategy=strategy, lr=1e-2, ps=0 if strategy == "sync" else 1, workers=2,
        batch_size=BATCH, epochs=EPOCHS, score_every=0.3, timeout=30, progress=False,
        client=client, failure=dt.FailureConfig(max_failures=3))
    return dt.Trainer(Slow(_net(), PACE), **{**options, **kw})


def _assert_every_sample_once(result: dt.FitResult) -> None:
    per_block = result.ledger.groupby(["epoch", "block"])["consumed"].sum()
    assert result.epochs_completed == EPOCHS, summary(result)
    assert len(per_block) == EPOCHS * ROWS // 1000 and (per_block == 1000).all(), per_block
    assert result.samples == EPOCHS * ROWS  # the servers applied each sample once


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_three_workers_killed_at_random_moments_of_a_job(client: Client, data: dict,
                                                         tmp_path: Path, strategy: str) -> None:
    watch = JobWatch(client)
    # Two SIGKILLs and a retirement (a scale-down, then a worker joins), in a seeded order.
    chaos = Schedule(client, seed=SEED, kinds=["trainer", "server", "scorer"], roles=watch.roles,
                     planned=EPOCHS * ROWS, workers=2, actions=["kill", "kill", "retire"])
    checkpoint = dt.CheckpointConfig(str(tmp_path), every_seconds=2.0, keep=2)
    try:
        result = _trainer(client, strategy, callbacks=[chaos], checkpoint=checkpoint).fit(
            data["X"], data["y"], validation=data["validation"])
    finally:
        chaos.stop()
    assert len(chaos.kills) == 2 and len(chaos.retired) == 1, (chaos.kills, summary(result))
    killed = {k["worker"] for k in chaos.kills}
    assert killed <= {f["worker"] for f in result.failures}, (chaos.kills, summary(result))
    # A retired role's worker hands over (a departure, nothing trained again), except a
    # scorer's: it holds no training state, and is started again elsewhere.
    [retired] = chaos.retired
    if retired["kind"] != "scorer":
        assert [d["workers"] for d in result.departures] == [[retired["worker"]]], \
            (chaos.retired, result.departures, summary(result))
        assert all(d["redone"] == 0 for d in result.departures)
    assert retired["worker"] not in {f["worker"] for f in result.failures}, summary(result)
    _assert_every_sample_once(result)
    # The same model and data in plain torch, one epoch; the job trained thirty.
    assert result.history["accuracy"].iloc[-1] >= data["reference"] - 0.03, summary(result)


def _loop(ctx: Any, *, validation: tuple[np.ndarray, np.ndarray]) -> None:
    """A ``dt.run`` loop as the README writes one: DDP, the state with each epoch's report."""
    torch.manual_seed(0)
    model = ctx.prepare(_net())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = ctx.restore()
    if state:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    xv, yv = (torch.from_numpy(a) for a in validation)
    for _ in ctx.epochs():
        for xb, yb in ctx.batches("train", batch_size=2 * BATCH):
            time.sleep(2 * PACE)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
        with torch.no_grad():
            accuracy = float((model.module(xv).argmax(1) == yv).float().mean())
        ctx.report({"accuracy": accuracy}, checkpoint={
            "model": model.module.state_dict(), "optimizer": optimizer.state_dict()})


@pytest.mark.timeout(300)
def test_three_ranks_killed_at_random_moments_of_a_dt_run_loop(client: Client,
                                                               data: dict) -> None:
    # No checkpoint=: a kill resumes from the last report's state, kept in another worker's
    # memory; a retired rank's worker hands over at the next report; the ranks regroup on one
    # worker and take in the nanny's (or the scale-up's) new worker at a report.
    chaos = Schedule(client, seed=SEED, kinds=["rank"] * 3,
                     roles=lambda: running_trainers(client), planned=EPOCHS * ROWS, workers=2,
                     actions=["kill", "kill", "retire"])
    try:
        result = dt.run(_loop, data={"train": (data["X"], data["y"])}, workers=(1, 2),
                        epochs=EPOCHS, config={"validation": data["validation"]},
                        callbacks=[chaos], failure=dt.FailureConfig(max_failures=3),
                        timeout=30, client=client)
    finally:
        chaos.stop()
    assert len(chaos.kills) == 2 and len(chaos.retired) == 1, (chaos.kills, summary(result))
    assert {k["worker"] for k in chaos.kills} <= {f["worker"] for f in result.failures}, \
        (chaos.kills, summary(result))
    [retired] = chaos.retired
    assert retired["worker"] not in {f["worker"] for f in result.failures}, summary(result)
    assert [d["workers"] for d in result.departures] == [[retired["worker"]]], \
        (chaos.retired, result.departures, summary(result))
    assert all(d["redone"] == 0 for d in result.departures)
    _assert_every_sample_once(result)
    assert result.history["accuracy"].dropna().iloc[-1] >= data["reference"] - 0.03, \
        summary(result)


@pytest.mark.timeout(300)
def test_three_trial_holders_killed_at_random_moments_of_a_search(client: Client,
                                                                  data: dict) -> None:
    # Trials long enough for three kills, each waiting for the cluster to be whole again (a
    # worker's restart, seconds on a loaded machine): at 4 epochs a trial trained in about a
    # second, and a fresh-clone CI run ended the search one kill short.
    epochs = 10
    chaos = Schedule(client, seed=SEED, kinds=["trainer"] * 3,
                     roles=lambda: running_trainers(client), planned=epochs * ROWS, workers=2,
                     fits=3)
    trainer = _trainer(client, "async-ps", epochs=epochs, callbacks=[chaos])
    try:
        search = dt.search(trainer, {"lr": [3e-3, 1e-2]}, data["X"], data["y"],
                           validation=data["validation"], n_trials=3, max_concurrent=1,
                           retries=2, pruner=None, timeout=60, progress=False, client=client)
    finally:
        chaos.stop()
    trials = search.trials
    assert len(chaos.kills) == 3, (chaos.kills, trials)
    assert list(trials["state"]) == ["complete"] * 3, trials
    for record in search.records:
        per_block = record.result.ledger.groupby(["epoch", "block"])["consumed"].sum()
        assert len(per_block) == epochs * ROWS // 1000 and (per_block == 1000).all()
        assert record.result.samples == epochs * ROWS
    assert search.best_score >= data["reference"] - 0.03, trials
