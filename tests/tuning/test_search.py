"""dt.search on a cluster of 4 worker processes (conftest's client4, shared with other modules):
gang-reserved distributed trials running at once, pruning, failures, a worker lost mid-trial,
Ctrl-C, XGBoost and GLM trials."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import optuna
import pytest
import torch
from _sampler import FixedSampler
from distributed import Client
from distributed.diagnostics.plugin import SchedulerPlugin
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.linear_model import LogisticRegression

import dask_train as dt
from dask_train.errors import InvalidInput


@pytest.fixture(autouse=True)
def _whole_cluster(client4: Client) -> None:
    client4.wait_for_workers(4, timeout=60)  # a worker an earlier test killed is back


@pytest.fixture(scope="module")
def digits(client4: Client) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    X, y = dt.datasets.digits(n_samples=4_000, chunks=500, seed=0)
    Xv, yv = dt.datasets.digits_test()
    return X, y, Xv, yv


def mlp(hidden: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


class SlowClassifier(ClassifierMixin, BaseEstimator):
    """Predicts the most common label after sleeping ``delay`` seconds in fit."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    def fit(self, X: np.ndarray, y: np.ndarray) -> SlowClassifier:
        time.sleep(self.delay)
        self.classes_ = np.unique(y)
        self.label_ = np.bincount(y.astype(int)).argmax()
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        return np.full(len(X), self.label_)


@pytest.mark.timeout(240)
def test_two_distributed_trials_run_at_once_each_on_its_own_workers(client4: Client,
                                                                    digits: Any) -> None:
    X, y, Xv, yv = digits
    trainer = dt.Trainer(mlp, strategy="async-ps", workers=2, ps=1, epochs=1, batch_size=64,
                         score_every=0.3, timeout=60)
    result = dt.search(trainer, {"lr": dt.loguniform(1e-3, 1e-2), "hidden": [16, 32]}, X, y,
                       validation=(Xv, yv), n_trials=2, max_concurrent=2, pruner=None,
                       timeout=60, progress=False, client=client4)
    trials = result.trials
    assert list(trials["state"]) == ["complete", "complete"], trials[["state", "error"]]
    first, second = (set(w.split(",")) for w in trials["workers"])
    assert len(first) == len(second) == 2 and not first & second  # 2 + 2 of the 4 workers
    assert trials["start_s"].max() < trials["end_s"].min()  # the two ran at the same time
    for record in result.records:
        fit = record.result
        assert set(fit.roles.addresses) <= set(record.workers)  # roles only on its own gang
        assert fit.epochs_completed == 1
    assert result.best_params in [r.params for r in result.records]
    assert result.best_score == trials["score"].max() > 0.3
    assert isinstance(result.best_model, torch.nn.Module)
    assert result.stopped_by == "n_trials=2"


@pytest.mark.timeout(240)
def test_asha_prunes_a_poor_trial_and_stops_its_job_early(client4: Client, digits: Any,
                                                          tmp_path: Any) -> None:
    X, y, Xv, yv = digits
    # Twenty epochs (about a second and a half): several scores for the pruner to act on. Four
    # took 0.2 s, fewer than the scores ASHA needs on a loaded machine, and the poor trial ran
    # to its end.
    trainer = dt.Trainer(mlp, workers=1, ps=1, epochs=20, batch_size=32, score_every=0.2)
    sampler = FixedSampler([{"lr": 3e-3}, {"lr": 1e-9}])  # the second cannot learn
    result = dt.search(trainer, {"lr": dt.loguniform(1e-9, 1e-2)}, X, y, validation=(Xv, yv),
                       n_trials=2, max_concurrent=1, sampler=sampler, pruner="asha",
                       progress=False, client=client4)
    good, poor = result.records
    assert good.state == "complete" and good.result.epochs_completed == 20
    assert poor.state == "pruned", result.trials[["state", "score", "stopped_by"]]
    assert poor.stopped_by == "pruned"
    assert poor.result.samples < 20 * 4_000  # stopped through the job's stop path, early
    assert result.best_params == {"lr": 3e-3}
    path = result.plot(tmp_path / "search.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(result.best_so_far()) >= 2


class _Decides(optuna.pruners.BasePruner):
    """Trial 0: prune at its first score; trial 1: prune at every score (its only one comes
    after its one epoch); trial 2: prune at a score >= 0.5 (where its StopAtScore fires)."""

    def prune(self, study: Any, trial: Any) -> bool:
        value = trial.intermediate_values[trial.last_step]
        return trial.number in (0, 1) or value >= 0.5


@pytest.mark.timeout(240)
def test_a_trial_is_pruned_only_when_the_pruner_ended_it(client4: Client, digits: Any) -> None:
    # The pruner says "prune" at the last score of trials 1 and 2 too; those ended by
    # themselves (their epochs, their stop condition), so they are complete, and optuna is
    # told so: only trial 0, stopped by the pruner mid-training, is pruned.
    X, y, Xv, yv = digits
    trainer = dt.Trainer(mlp, workers=1, ps=1, batch_size=32,
                         stop=[dt.StopAtScore("accuracy", 0.5)])
    sampler = FixedSampler([{"lr": 1e-9, "epochs": 40, "score_every": 0.1},
                            {"lr": 1e-9, "epochs": 1, "score_every": 60.0},
                            {"lr": 3e-3, "epochs": 40, "score_every": 0.1}])
    result = dt.search(trainer, {"lr": dt.loguniform(1e-9, 1e-2), "epochs": dt.intuniform(1, 40),
                                 "score_every": dt.uniform(0.1, 60.0)}, X, y,
                       validation=(Xv, yv), n_trials=3, max_concurrent=3, sampler=sampler,
                       pruner=_Decides(), progress=False, client=client4)
    shown = result.trials[["number", "state", "score", "stopped_by"]]
    pruned, finished, reached = sorted(result.records, key=lambda r: r.number)
    assert pruned.state == "pruned" and pruned.stopped_by == "pruned", shown
    assert pruned.result.epochs_completed < 40
    assert finished.state == "complete" and finished.stopped_by == "epochs=1", shown
    assert reached.state == "complete", shown
    assert reached.stopped_by == "StopAtScore(accuracy>=0.5)" and reached.score >= 0.5
    states = {t.number: t.state for t in result.study.trials}
    assert states == {0: optuna.trial.TrialState.PRUNED, 1: optuna.trial.TrialState.COMPLETE,
                      2: optuna.trial.TrialState.COMPLETE}
    assert result.study.best_trial.number == 2


@pytest.mark.timeout(180)
def test_a_failing_trial_is_recorded_and_the_search_goes_on(client4: Client, digits: Any) -> None:
    X, y, Xv, yv = digits
    sampler = FixedSampler([{"C": 1.0}, {"C": -1.0}, {"C": 0.1}])  # C=-1 is refused by fit
    result = dt.search(LogisticRegression(max_iter=300), {"C": dt.uniform(-1.0, 1.0)}, X, y,
                       validation=(Xv, yv), n_trials=3, sampler=sampler, progress=False,
                       client=client4)
    assert list(result.trials["state"]) == ["complete", "failed", "complete"]
    assert "C" in result.trials["error"].iloc[1] and "InvalidParameterError" in \
        result.trials["error"].iloc[1]
    assert result.best_score > 0.8
    assert result.study.trials[1].state == optuna.trial.TrialState.FAIL


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:the solver stopped")  # a short fit on purpose
def test_glm_trials_run_one_per_worker(client4: Client, digits: Any) -> None:
    X, y, Xv, yv = digits
    result = dt.search(dt.LogisticRegression(max_iter=30), {"C": dt.loguniform(1e-2, 1e1)}, X,
                       y, validation=(Xv, yv), n_trials=8, max_concurrent=2,
                       stop=[dt.StopAtScore("accuracy", 0.5)], progress=False, client=client4)
    trials = result.trials
    # The first trial to score 0.5 ends the search: the one running beside it finishes, no
    # other starts.
    assert result.stopped_by == "StopAtScore(accuracy>=0.5)"
    assert list(trials["state"]) == ["complete"] * 2
    assert all(len(w.split(",")) == 1 for w in trials["workers"])
    assert 0.8 < result.best_score <= 1.0
    labels = dt.predict(result.best_model, Xv).compute()
    assert float(np.mean(labels == yv)) == pytest.approx(result.best_score)


@pytest.mark.timeout(180)
def test_a_trial_whose_worker_dies_fails_and_the_others_finish(client4: Client,
                                                               digits: Any) -> None:
    X, y, Xv, yv = digits
    killed: list[str] = []

    def kill_the_slow_trials_worker() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed:
            for worker, keys in client4.processing().items():
                if any(str(k).startswith("dt-trial-0-") for k in keys):
                    [pid] = client4.run(os.getpid, workers=[worker]).values()
                    os.kill(pid, signal.SIGKILL)
                    killed.append(worker)
                    return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_the_slow_trials_worker, daemon=True)
    watcher.start()
    sampler = FixedSampler([{"delay": 60.0}, {"delay": 0.0}, {"delay": 0.0}])
    started = time.monotonic()
    result = dt.search(SlowClassifier(), {"delay": dt.uniform(0.0, 60.0)}, X, y,
                       validation=(Xv, yv), n_trials=3, max_concurrent=2, sampler=sampler,
                       progress=False, client=client4)
    watcher.join(timeout=5)
    assert killed, "the slow trial never started"
    assert time.monotonic() - started < 50  # not the 60 s the lost trial would have slept
    states = dict(zip(result.trials["number"], result.trials["state"]))
    assert states == {0: "failed", 1: "complete", 2: "complete"}
    assert "WorkerLost" in result.trials["error"].iloc[0] and killed[0] in \
        result.trials["error"].iloc[0]
    client4.wait_for_workers(4, timeout=60)  # the nanny brings the worker back for the next tests


class Watch(dt.Callback):
    """Counts the trials' fits starting and ending (callbacks are shared by every trial)."""

    def __init__(self) -> None:
        self.started, self.ended, self.lock = 0, 0, threading.Lock()

    def on_fit_start(self, info: Any) -> None:
        with self.lock:
            self.started += 1

    def on_fit_end(self, result: Any) -> None:
        with self.lock:
            self.ended += 1


@pytest.mark.timeout(180)
def test_ctrl_c_stops_the_running_trials_and_returns_what_finished(client4: Client,
                                                                   digits: Any,
                                                                   ctrl_c: None) -> None:
    X, y, Xv, yv = digits
    watch = Watch()

    def press_ctrl_c() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (watch.ended >= 1 and watch.started >= 2):
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    presser.start()
    trainer = dt.Trainer(mlp, workers=1, ps=1, batch_size=64, score_every=0.3, callbacks=[watch])
    sampler = FixedSampler([{"epochs": 1}, {"epochs": 500}, {"epochs": 1}])
    started = time.monotonic()
    result = dt.search(trainer, {"epochs": [1, 500]}, X, y, validation=(Xv, yv), n_trials=3,
                       max_concurrent=2, sampler=sampler, pruner=None, progress=False,
                       client=client4)
    presser.join(timeout=5)
    assert time.monotonic() - started < 120
    assert result.stopped_by == "KeyboardInterrupt"
    states = dict(zip(result.trials["number"], result.trials["state"]))
    assert states[0] == "complete" and states[1] == "interrupted"
    assert 2 not in states or states[2] in ("complete", "interrupted")
    long_trial = next(r for r in result.records if r.number == 1)
    assert long_trial.result.samples < 500 * 4_000  # its job was stopped, not left running
    assert result.best_trial == 0 or states.get(2) == "complete"
    assert not [t for t in threading.enumerate() if t.name.startswith("dt-trial-")]


@pytest.mark.timeout(240)
def test_xgboost_trials_train_on_their_gangs(client4: Client, digits: Any) -> None:
    import xgboost.dask

    X, y, Xv, yv = digits
    model = xgboost.dask.DaskXGBClassifier(tree_method="hist", n_estimators=8)
    result = dt.search(model, {"max_depth": dt.intuniform(2, 4),
                               "learning_rate": dt.loguniform(0.1, 0.5)}, X, y,
                       validation=(Xv, yv), n_trials=2, max_concurrent=2, workers_per_trial=2,
                       pruner=None, progress=False, client=client4)
    trials = result.trials
    assert list(trials["state"]) == ["complete", "complete"], trials[["state", "error"]]
    first, second = (set(w.split(",")) for w in trials["workers"])
    assert not first & second
    assert list(trials["stopped_by"]) == ["rounds=8", "rounds=8"]
    labels = dt.predict(result.best_model, Xv).compute()
    assert float(np.mean(labels == yv)) == pytest.approx(result.best_score, abs=1e-6)
    assert result.best_score > 0.7


class _NewWork(SchedulerPlugin):
    """On the scheduler: the graphs submitted after it is added, and the keys that were not
    there then (a task of a submitted graph, or scattered data) seen in a transition or still
    held. Tasks of earlier tests released meanwhile are not new work (counting the scheduler's
    live tasks did count them: 4 -> 0 in a full run)."""

    name = "dt-test-new-work"

    def __init__(self, known: set[Any]) -> None:
        self.known = known
        self.graphs: list[list[str]] = []
        self.new: set[str] = set()

    def update_graph(self, scheduler: Any, *, keys: set[Any], **kwargs: Any) -> None:
        self.graphs.append(sorted(map(str, keys)))

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if key not in self.known:
            self.new.add(str(key))


def _watch_new_work(dask_scheduler: Any) -> None:
    dask_scheduler.add_plugin(_NewWork(set(dask_scheduler.tasks)), name=_NewWork.name)


def _new_work(dask_scheduler: Any) -> dict[str, list[Any]]:
    plugin = dask_scheduler.plugins.pop(_NewWork.name)
    held = {str(k) for k in dask_scheduler.tasks if k not in plugin.known}
    return {"graphs": plugin.graphs, "keys": sorted(plugin.new | held)}


def test_bad_arguments_are_refused_before_any_work(client4: Client, digits: Any) -> None:
    X, y, Xv, yv = digits
    client4.run_on_scheduler(_watch_new_work)
    with pytest.raises(InvalidInput) as info:
        dt.search(dt.Trainer(mlp, workers=2), {"lrr": [0.1], "lr": dt.loguniform(0.0, 1.0)}, X,
                  y, validation=(Xv, yv), n_trials=0, pruner="hyperband", client=client4)
    problems = info.value.problems
    assert any("n_trials=0" in p for p in problems)
    assert any("pruner='hyperband'" in p for p in problems)
    assert any("log range needs low > 0" in p for p in problems)
    with pytest.raises(InvalidInput) as info:
        dt.search(dt.Trainer(mlp, workers=2), {"lrr": [0.1]}, X, y, validation=(Xv, yv),
                  workers_per_trial=9, metric="acc", client=client4)
    problems = info.value.problems
    assert any("space['lrr'] is not a parameter" in p for p in problems)
    assert any("needs 9 workers and the cluster has 4" in p for p in problems)
    with pytest.raises(InvalidInput, match="metric='acc' is not a score"):
        dt.search(dt.Trainer(mlp, workers=2), {"hidden": [8]}, X, y, validation=(Xv, yv),
                  metric="acc", client=client4)
    # A graph of the test's own, submitted last and waited for, comes after any graph the calls
    # above sent (the scheduler reads a client's graphs in order), and shows the watch sees one.
    assert client4.submit(int, key="refused-calls-marker").result(timeout=30) == 0
    new_work = client4.run_on_scheduler(_new_work)
    assert new_work == {"graphs": [["refused-calls-marker"]], "keys": ["refused-calls-marker"]}
