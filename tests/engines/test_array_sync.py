"""strategy="sync" for an ArrayModel: gradients averaged by a Dask tree reduction, no torch group."""

from __future__ import annotations

import dataclasses
import math
import shutil

import dask.array as da
import numpy as np
import pytest
from distributed import Client

import dask_train as dt
from dask_train.controller._controller import Controller
from dask_train.data import BlockSet
from dask_train.data._cluster import live_workers
from dask_train.engines._spec import JobSpec, TrainSettings
from dask_train.engines.array.engine import ArrayEngine
from dask_train.policy import FailureConfig, Roles
from dask_train.policy._settings import OptimizerSettings


def _least_squares(params: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    r = X @ params - y
    return 0.5 * float(r @ r), X.T @ r


def _job(**overrides: object) -> JobSpec:
    train: dict = dict(module=None, n_params=3, loss="", optim=OptimizerSettings("sgd", 0.01),
                       grad_accumulation=1, prefetch=0, score_every=1e9, scorer=0)
    train.update({k: overrides.pop(k) for k in list(overrides)
                  if k in TrainSettings.__dataclass_fields__})
    settings: dict = dict(batch_size=7, epochs=2, shuffle=True, seed=3, blocks_ahead=1,
                          timeout=60.0, stop=[], callbacks=[], progress=False, strategy="sync",
                          workers=1, failure=FailureConfig(), on_nan="stop",
                          train=TrainSettings(**train))
    settings.update(overrides)
    return JobSpec(**settings)


class _Run:
    """What the tests read of a run of the numpy engine under the one controller."""

    def __init__(self, outcome) -> None:
        self.steps, self.samples = outcome.ending.steps, outcome.ending.samples
        self.params = outcome.ending.params
        self.stopped_by, self.epochs_completed = outcome.stopped_by, outcome.epochs_completed
        self.ledger, self.trainers = outcome.ledger, outcome.ending.trainers
        self.nonfinite = outcome.log.nonfinite


def _run(client: Client, model: dt.ArrayModel, data: BlockSet, job: JobSpec) -> _Run:
    # JobSpec is frozen
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, module=model,
                                                             n_params=model.params.size))

    def make_engine(roles, key, restore):
        return ArrayEngine(client, job, data, None, job=key, restore=restore)

    controller = Controller(client, job, make_engine=make_engine, plan_roles=lambda alive: Roles(),
                            roles=Roles(), rows=data.n_rows)
    return _Run(client.sync(controller.run))


def _order(seed: int, epoch: int, group: int, rows: int) -> np.ndarray:
    # The documented contract of a group's row order, written out here: a permutation seeded
    # by (seed, epoch, group) with numpy's default generator.
    return np.random.default_rng([seed, epoch, group]).permutation(rows)


def _placed(client: Client, blocks: list[tuple[np.ndarray, np.ndarray]], where: list[int],
            threads: int = 1) -> BlockSet:
    """Blocks scattered to chosen workers (index into the sorted worker list).

    ``threads`` per worker sets the groups: one task per thread's share of a worker's blocks.
    """
    workers = sorted(live_workers(client))
    # hash=False: tests that scatter the same blocks must not share (and release) one key.
    futures = [client.scatter([b], workers=[workers[w]], direct=True, hash=False)[0]
               for b, w in zip(blocks, where)]
    return BlockSet.placed(futures, [len(b[0]) for b in blocks], [workers[w] for w in where],
                           n_features=blocks[0][0].shape[1], client=client,
                           threads={w: threads for w in workers})


def _problem(rows: list[int], seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    w = np.array([1.0, -2.0, 0.5])
    out = []
    for n in rows:
        X = rng.normal(size=(n, 3))
        out.append((X, X @ w + 0.01 * rng.normal(size=n)))
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_two_workers_equal_one_process_sgd_on_the_concatenated_batches(
    client: Client, threads: int
) -> None:
    # threads=1: 2 groups, whose partials the client adds; threads=2: 4 groups, a tree of tasks.
    blocks = _problem([20, 15, 30, 9])
    data = _placed(client, blocks, [0, 1, 0, 1], threads)
    model = dt.ArrayModel(np.zeros(3), _least_squares)
    job = _job()
    got = _run(client, model, data, job)

    # The same steps in one process: each group's rows end to end, in its epoch order.
    groups = data.groups()
    group_xy = [(np.concatenate([blocks[i][0] for i in g]), np.concatenate([blocks[i][1] for i in g]))
                for g in groups]
    params, steps = np.zeros(3), 0
    for epoch in range(job.epochs):
        n_steps = max(math.ceil(len(x) / job.batch_size) for x, _ in group_xy)
        for s in range(n_steps):
            xs, ys = [], []
            for g, (x, y) in enumerate(group_xy):
                idx = _order(job.seed, epoch, g, len(x))[s * 7 : (s + 1) * 7]
                xs.append(x[idx])
                ys.append(y[idx])
            X, Y = np.concatenate(xs), np.concatenate(ys)
            params = params - job.train.optim.lr * _least_squares(params, X, Y)[1] / len(X)
            steps += 1
    assert len(groups) == 2 * threads
    longest = max(len(x) for x, _ in group_xy)
    assert got.steps == steps == 2 * math.ceil(longest / 7)
    assert got.samples == 2 * 74
    np.testing.assert_allclose(got.params, params, rtol=1e-10, atol=1e-12)
    assert got.stopped_by == "epochs=2"


def test_uneven_groups_finish_every_epoch_and_read_each_row_once(client: Client) -> None:
    blocks = _problem([10, 10, 10, 10])
    data = _placed(client, blocks, [0, 0, 0, 1])  # 3 blocks against 1
    got = _run(client, dt.ArrayModel(np.zeros(3), _least_squares), data,
               _job(epochs=3, batch_size=4))
    assert got.epochs_completed == 3
    assert got.samples == 3 * 40
    assert got.steps == 3 * math.ceil(30 / 4)  # the longest group sets the steps
    assert all(entry["consumed"] == entry["rows"] for entry in got.ledger)
    assert sorted(t["rows"] for t in got.trainers) == [10, 30]


@pytest.fixture(scope="module")
def digits() -> tuple[da.Array, da.Array, tuple[np.ndarray, np.ndarray]]:
    X, y = dt.datasets.digits(6_000, seed=0, chunks=1_500)
    return X, y, dt.datasets.digits_test()


def test_trainer_fits_a_softmax_regression_with_scores_and_history(client: Client, digits: tuple) -> None:
    X, y, validation = digits
    trainer = dt.Trainer(dt.softmax_regression(64, 10), strategy="sync", optimizer="adam", lr=0.05,
                         batch_size=256, epochs=3, score_every=0.01, progress=False, client=client)
    result = trainer.fit(X, y, validation=validation)
    assert isinstance(result.model, dt.ArrayModel)
    assert result.stopped_by == "epochs=3"
    assert result.epochs_completed == 3 and result.samples == 3 * 6_000
    assert len(result.history) >= 2
    assert result.history["step"].is_monotonic_increasing
    # A linear model on these generated digits levels off near 0.8 (chance is 0.1).
    assert result.history["accuracy"].iloc[-1] > 0.7
    assert result.history["loss"].iloc[-1] < result.history["loss"].iloc[0]
    # The returned parameters are the trained ones: they score what the history says.
    accuracy = np.mean(result.model.predict(result.model.params, validation[0]) == validation[1])
    assert accuracy == pytest.approx(result.history["accuracy"].iloc[-1])
    assert len(result.roles["trainer"]) == 2 and len(result.roles["scorer"]) == 1


def test_stop_at_step_is_exact_and_a_score_stop_returns_the_scored_parameters(
    client: Client, digits: tuple
) -> None:
    X, y, validation = digits
    base = dict(strategy="sync", optimizer="adam", lr=0.05, batch_size=128, epochs=20,
                progress=False, client=client)
    result = dt.Trainer(dt.softmax_regression(64, 10), stop=dt.StopAtStep(9), **base).fit(
        X, y, validation=validation)
    assert result.steps == 9 and result.stopped_by == "StopAtStep(9)"

    result = dt.Trainer(dt.softmax_regression(64, 10), stop=dt.StopAtScore("accuracy", 0.6),
                        score_every=0.01, **base).fit(X, y, validation=validation)
    assert result.stopped_by == "StopAtScore(accuracy>=0.6)"
    accuracy = np.mean(result.model.predict(result.model.params, validation[0]) == validation[1])
    hit = result.history[result.history["accuracy"] >= 0.6]
    assert len(hit) and accuracy == pytest.approx(hit["accuracy"].iloc[0])
    assert result.model_step == hit["step"].iloc[0] <= result.steps


def test_a_nan_row_is_skipped_or_stops_the_job(client: Client) -> None:
    blocks = _problem([12, 12])
    blocks[1][0][5, 1] = np.nan
    for on_nan, steps in (("skip", 2 * 3 - 2), ("stop", None)):
        data = _placed(client, [(x.copy(), y.copy()) for x, y in blocks], [0, 1])
        got = _run(client, dt.ArrayModel(np.zeros(3), _least_squares), data,
                   _job(batch_size=4, shuffle=False, on_nan=on_nan))
        assert got.nonfinite and got.nonfinite[0]["step"] == 1  # rows 4-7: the second batch
        if on_nan == "skip":
            assert got.steps == steps and got.stopped_by == "epochs=2"
            assert np.isfinite(got.params).all()
        else:
            assert got.steps == 1 and got.stopped_by.startswith("non-finite loss")


def _bad_shape(params: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    return 0.0, np.zeros(len(params) + 1)


@pytest.mark.parametrize(
    ("model", "settings", "needle"),
    [
        (dt.ArrayModel(np.zeros(65 * 10), _bad_shape), {}, "gradient of shape (651,)"),
        (dt.ArrayModel(np.zeros((2, 3)), _least_squares), {}, "ArrayModel.params has shape (2, 3)"),
        (dt.ArrayModel(np.zeros(3), "nope"), {}, "ArrayModel.loss_grad='nope' is not callable"),
        (dt.softmax_regression(64, 10), {"strategy": "async-ps"}, "strategy='async-ps' cannot train"),
        (dt.ArrayModel(np.zeros(3), _least_squares), {},
         "loss_grad failed on 2 rows shaped like X (2, 64)"),
    ],
)
def test_bad_array_models_are_refused_before_training(
    client: Client, digits: tuple, model: dt.ArrayModel, settings: dict, needle: str
) -> None:
    X, y, validation = digits
    trainer = dt.Trainer(model, **{"strategy": "sync", "progress": False, "client": client,
                                   **settings})
    with pytest.raises(dt.InvalidInput) as info:
        trainer.fit(X, y, validation=validation)
    assert needle in str(info.value)


def test_grad_accumulation_multiplies_the_rows_of_a_step(client: Client) -> None:
    blocks = _problem([16, 16])
    steps = {}
    for k in (1, 4):
        data = _placed(client, blocks, [0, 1])
        steps[k] = _run(client, dt.ArrayModel(np.zeros(3), _least_squares), data,
                        _job(batch_size=2, grad_accumulation=k, epochs=1)).steps
    assert steps == {1: 8, 4: 2}


def test_checkpoints_and_an_exact_resume(client: Client, digits: tuple, tmp_path) -> None:
    # A whole run that checkpoints about every 10 steps; then every checkpoint after the first is
    # deleted and the job resumed from it: it ends on exactly the whole run's parameters.
    X, y, _ = digits
    ckpt = dt.CheckpointConfig(tmp_path / "ckpt", every_seconds=None, every_steps=10, keep=100)
    base = dict(strategy="sync", optimizer="adam", lr=0.05, batch_size=64, epochs=2,
                progress=False, client=client, score_every=1e9, checkpoint=ckpt)
    whole = dt.Trainer(dt.softmax_regression(64, 10), **base).fit(X, y)
    steps = [c["step"] for c in whole.checkpoints]
    assert len(steps) >= 2 and steps[-1] == whole.steps and whole.checkpoints[-1]["final"]
    for info in whole.checkpoints:
        if info["step"] > steps[0]:
            shutil.rmtree(info["directory"])
    resumed = dt.Trainer(dt.softmax_regression(64, 10), **base).fit(X, y, resume=True)
    assert resumed.steps == whole.steps and resumed.samples == whole.samples
    assert resumed.epochs_completed == 2
    np.testing.assert_array_equal(resumed.model.params, whole.model.params)


def test_a_worker_killed_mid_training_is_survived(tmp_path) -> None:
    # A cluster of its own: a worker holding blocks is SIGKILLed once training is under way. The
    # job ends every epoch with every row applied once: Dask recomputes the lost blocks for the
    # steps in flight, or the controller restarts from the newest checkpoint.
    import os
    import signal

    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as own:
        X, y = dt.datasets.digits(6_000, seed=0, chunks=1_500)
        victim = sorted(live_workers(own))[0]
        pid = own.run(os.getpid, workers=[victim])[victim]

        class KillOnce(dt.Callback):
            killed = False

            def on_score(self, record):
                if not self.killed and record["step"] >= 10:
                    os.kill(pid, signal.SIGKILL)
                    self.killed = True

        kill = KillOnce()
        result = dt.Trainer(
            dt.softmax_regression(64, 10), strategy="sync", optimizer="adam", lr=0.05,
            batch_size=128, epochs=3, score_every=0.05, timeout=30, progress=False, client=own,
            callbacks=[kill], checkpoint=dt.CheckpointConfig(tmp_path / "ckpt", every_steps=5),
        ).fit(X, y, validation=dt.datasets.digits_test())
    assert kill.killed
    assert result.stopped_by == "epochs=3" and result.epochs_completed == 3
    assert result.samples == 3 * 6_000
    assert result.history["accuracy"].iloc[-1] > 0.7
