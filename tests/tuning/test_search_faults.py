"""dt.search when a worker running a trial is SIGKILLed mid-trial, for each kind of trial (a
Trainer, an XGBoost estimator, a scikit-learn estimator): the trial is recorded as failed, or run
again on fresh workers when the search asks (``retries=``), and the other trials finish."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
import torch
from _sampler import FixedSampler
from distributed import Client
from sklearn.base import BaseEstimator, ClassifierMixin

import dask_train as dt
from dask_train.errors import InvalidInput


@pytest.fixture(scope="module")
def digits(client4: Client) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    X, y = dt.datasets.digits(n_samples=4_000, chunks=500, seed=0)
    Xv, yv = dt.datasets.digits_test()
    return X, y, Xv, yv


@pytest.fixture(autouse=True)
def _whole_cluster(client4: Client) -> Iterator[None]:
    # conftest's four workers, shared with other modules: whole before, and again after (the
    # nanny brings a killed worker back).
    client4.wait_for_workers(4, timeout=60)
    yield
    client4.wait_for_workers(4, timeout=60)


def _first_time(marker: Path) -> bool:
    """True for the first caller only, in any process (the file is created atomically)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))


class KillAtFirstScore(dt.Callback):
    """SIGKILLs the worker holding the first trial's roles when that trial is first scored
    (callbacks are shared by a search's trials; the pids were read with client.run)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids, self.roles, self.killed = pids, None, ""

    def on_fit_start(self, info: Any) -> None:
        self.roles = self.roles or info["roles"]

    def on_score(self, record: Any) -> None:
        if not self.killed and self.roles is not None and record.get("samples", 0) > 0:
            self.killed = self.roles.addresses[0]
            os.kill(self.pids[self.killed], signal.SIGKILL)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("retries", [0, 1])
def test_a_trainer_trial_whose_worker_is_killed(client4: Client, digits: Any,
                                                retries: int) -> None:
    X, y, Xv, yv = digits
    killer = KillAtFirstScore(client4.run(os.getpid))
    # Trial 0 trains long enough to be scored before it ends; 1 and 2 are short.
    trainer = dt.Trainer(mlp, workers=1, ps=1, batch_size=64, score_every=0.3, timeout=60,
                         callbacks=[killer])
    sampler = FixedSampler([{"epochs": 60}, {"epochs": 2}, {"epochs": 2}])
    result = dt.search(trainer, {"epochs": dt.intuniform(1, 60)}, X, y, validation=(Xv, yv),
                       n_trials=3, max_concurrent=1, sampler=sampler, pruner=None,
                       retries=retries, progress=False, client=client4)
    trials = result.trials
    assert killer.killed
    assert list(trials["state"][1:]) == ["complete", "complete"]  # the others finish
    first = result.records[0]
    if retries == 0:
        assert first.state == "failed" and first.attempts == 1
        # ParameterServerLost: the trial's one worker held its server too.
        assert "Lost: " in first.error and killer.killed in first.error
        assert result.study.trials[0].state == optuna.trial.TrialState.FAIL
    else:
        assert first.state == "complete", trials[["state", "error"]]
        assert first.attempts == 2 and list(trials["attempts"]) == [2, 1, 1]
        [why] = first.retried_after
        assert "Lost: " in why and killer.killed in why
        assert killer.killed not in first.workers  # run again on a live worker
        assert first.result.epochs_completed == 60  # from its start, to its end
        assert result.study.trials[0].state == optuna.trial.TrialState.COMPLETE


@pytest.mark.timeout(240)
def test_in_memory_data_beyond_the_embedding_limit_is_sent_again(
        client4: Client, caplog: pytest.LogCaptureFixture) -> None:
    """In-memory search data over 64 MiB is scattered, which Dask cannot recompute: the worker
    holding the first trial (and a share of the data) is killed mid-trial, and the client sends
    that share again, so the retried trial and the later ones train (they all failed on 'lost
    dependencies' before)."""
    from dask_train.tuning._data import EMBED_SEARCH_BYTES

    rng = np.random.default_rng(0)
    X = rng.normal(size=(260_000, 64)).astype(np.float32)
    y = (X[:, :10] @ rng.normal(size=(10, 10))).argmax(axis=1)
    assert X.nbytes + y.nbytes > EMBED_SEARCH_BYTES  # the scattered path, at its real size
    Xv, yv = X[:2_000].copy(), y[:2_000].copy()
    killer = KillAtFirstScore(client4.run(os.getpid))
    # Steps enough that the first score (0.3 s) comes well inside the first trial.
    trainer = dt.Trainer(mlp, workers=1, ps=1, batch_size=64, score_every=0.3, timeout=60,
                         stop=[dt.StopAtStep(2_000)], callbacks=[killer])
    sampler = FixedSampler([{"lr": 1e-2}, {"lr": 3e-3}, {"lr": 1e-3}])
    result = dt.search(trainer, {"lr": dt.loguniform(1e-3, 1e-2)}, X, y, validation=(Xv, yv),
                       n_trials=3, max_concurrent=1, sampler=sampler, pruner=None, retries=1,
                       progress=False, client=client4)
    assert killer.killed
    trials = result.trials
    # The trial hit survives in its own job (a new generation) or runs again (retries=1).
    assert list(trials["state"]) == ["complete"] * 3, trials[["state", "error"]]
    assert "sent it again from the client" in caplog.text
    # One trial at most runs twice: the one the kill hit. That is the first, or, on a loaded
    # machine where callbacks (run on their own thread) read its first score only once it had
    # ended, the next one, started on the same worker (seen once under a CPU burner). Every
    # other trial trains on the resent data at its first attempt.
    attempts = list(trials["attempts"])
    assert sorted(attempts) in ([1, 1, 1], [1, 1, 2]), attempts
    assert all(r.result.steps >= 2_000 for r in result.records)
    assert result.records[0].score > 0.3  # trained on every share: ten classes, chance is 0.1


def _xgb_killer(marker: Path) -> Any:
    """An XGBoost callback: rank 1 SIGKILLs its own worker at round 10, the first time only."""
    from xgboost import collective
    from xgboost.callback import TrainingCallback

    class KillOnce(TrainingCallback):  # type: ignore[misc]
        def after_iteration(self, model: Any, epoch: int, evals_log: Any) -> bool:
            if epoch == 10 and collective.get_rank() == 1 and _first_time(marker):
                os.kill(os.getpid(), signal.SIGKILL)
            return False

    return KillOnce()


@pytest.mark.timeout(240)
def test_an_xgboost_trial_whose_worker_is_killed_runs_again(client4: Client, digits: Any,
                                                            tmp_path: Path) -> None:
    import xgboost.dask

    X, y, Xv, yv = digits
    marker = tmp_path / "killed"
    model = xgboost.dask.DaskXGBClassifier(tree_method="hist", n_estimators=40,
                                           callbacks=[_xgb_killer(marker)])
    sampler = FixedSampler([{"max_depth": 3}, {"max_depth": 2}])
    # One trial at a time, as on three workers (one gang of two): the kill at round 10 of the
    # first rank 1 to reach it is then trial 0's.
    result = dt.search(model, {"max_depth": [2, 3]}, X, y, validation=(Xv, yv), n_trials=2,
                       max_concurrent=1, sampler=sampler, pruner=None, retries=1, timeout=30,
                       progress=False, client=client4)
    assert marker.exists()
    first, second = result.records
    assert first.state == second.state == "complete", result.trials[["state", "error"]]
    assert first.attempts == 2 and second.attempts == 1
    [why] = first.retried_after
    assert why.startswith("WorkerLost: worker tcp://") and "trial 0" in why
    assert first.stopped_by == "rounds=40" and first.score > 0.8


class KillOnceClassifier(ClassifierMixin, BaseEstimator):
    """Predicts the most common label; its fit SIGKILLs its own worker the first time it runs
    with ``kill=True`` and raises for ``fail=True`` (its own error, not a lost worker)."""

    def __init__(self, marker: str = "", kill: bool = False, fail: bool = False) -> None:
        self.marker, self.kill, self.fail = marker, kill, fail

    def fit(self, X: np.ndarray, y: np.ndarray) -> KillOnceClassifier:
        if self.kill and _first_time(Path(self.marker)):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fail:
            raise ValueError("fail=True")
        self.classes_ = np.unique(y)
        self.label_ = np.bincount(y.astype(int)).argmax()
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        return np.full(len(X), self.label_)


@pytest.mark.timeout(180)
def test_an_estimator_trial_whose_worker_is_killed_runs_again(client4: Client, digits: Any,
                                                              tmp_path: Path) -> None:
    X, y, Xv, yv = digits
    marker = tmp_path / "killed"
    sampler = FixedSampler([{"kill": True, "fail": False}, {"kill": False, "fail": True},
                            {"kill": False, "fail": False}])
    result = dt.search(KillOnceClassifier(marker=str(marker)),
                       {"kill": [True, False], "fail": [True, False]}, X, y,
                       validation=(Xv, yv), n_trials=3, max_concurrent=1, sampler=sampler,
                       retries=1, progress=False, client=client4)
    assert marker.exists()
    killed, failing, plain = result.records
    assert killed.state == "complete" and killed.attempts == 2, result.trials[["state", "error"]]
    assert "WorkerLost" in killed.retried_after[0]
    # Its own error is not a lost worker: recorded once, not run again.
    assert failing.state == "failed" and failing.attempts == 1
    assert failing.error == "ValueError: fail=True" and not failing.retried_after
    assert plain.state == "complete"
    assert killed.score == plain.score  # the same model, fitted in full on its second run


def test_retries_must_be_a_count() -> None:
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(InvalidInput) as info:
            dt.search(KillOnceClassifier(), {"fail": [False]}, np.zeros((8, 2)), np.zeros(8),
                      validation=(np.zeros((2, 2)), np.zeros(2)), retries=bad)  # type: ignore[arg-type]
        assert f"retries={bad!r} is invalid: use an integer >= 0" in str(info.value)
