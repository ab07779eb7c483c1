"""dt.callbacks.MLflow on a real cluster, read back with MLflow's own client from its local file
store: a Trainer job's parameters, every score and the model; a dt.run job logged into the run
active where it was started, through MLFLOW_TRACKING_URI, with its newest checkpoint."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

# Imported, not skipped when missing: make test installs the mlflow extra.
import mlflow  # noqa: E402
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dask_train as dt
from dask_train.checkpoint import load_tensors


@pytest.fixture(autouse=True)
def _file_store(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflow 3 refuses its file store unless asked (it recommends a database); the file store
    # needs no migrations and is what a user's local ./mlruns is.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def history_of(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def recorded(history, column: str) -> list[tuple[int, float]]:
    rows = history[["step", column]].dropna()
    return [(int(s), float(v)) for s, v in zip(rows["step"], rows[column])]


def test_a_trainer_job_is_logged_with_every_score_and_its_model(client, tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/mlruns"
    X, y = dt.datasets.digits(n_samples=6_000)
    Xv, yv = dt.datasets.digits(n_samples=500, seed=7)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    tracker = dt.callbacks.MLflow(experiment="digits", run_name="adam", tracking_uri=uri)
    trainer = dt.Trainer(net, loss="cross_entropy", optimizer="adam", lr=3e-3, strategy="sync",
                         workers=2, batch_size=64, epochs=20, score_every=0.05, progress=False,
                         optimizer_options={"weight_decay": 1e-4}, callbacks=[tracker],
                         client=client)
    result = trainer.fit(X, y, validation=(np.asarray(Xv), np.asarray(yv)))

    reader = mlflow.MlflowClient(tracking_uri=uri)
    run = reader.get_run(tracker.run_id)
    assert run.info.run_name == "adam" and run.info.status == "FINISHED"
    assert reader.get_experiment(run.info.experiment_id).name == "digits"
    params = run.data.params
    assert params["lr"] == "0.003" and params["strategy"] == "sync"
    assert params["batch_size"] == "64" and params["optimizer_options.weight_decay"] == "0.0001"
    assert params["module"] == "Sequential" and "callbacks" not in params
    # Every score of the history, at its step, and nothing else. Twenty epochs: three trained
    # in 0.2 s, before the scorer's first score (the final one then was the only row).
    assert len(result.history) >= 2
    for metric in ("accuracy", "loss", "epoch"):
        logged, expected = history_of(reader, run.info.run_id, metric), \
            recorded(result.history, metric)
        assert [s for s, _ in logged] == [s for s, _ in expected], metric
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected]), metric
    # The model: a safetensors file holding the trained parameters.
    local = reader.download_artifacts(run.info.run_id, "model/model.safetensors",
                                      str(tmp_path / "down"))
    tensors = load_tensors(local)
    for name, value in result.model.state_dict().items():
        assert torch.equal(tensors[name], value), name


def count_up(ctx, lr=0.1, epochs=3):
    net = ctx.prepare(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for epoch in ctx.epochs(epochs):
        for xb, yb in ctx.batches():
            opt.zero_grad()
            loss = F.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
        ctx.report({"loss": loss.item(), "epoch_done": epoch},
                   checkpoint={"net": net.module.state_dict(), "epoch": epoch})
    return ctx.rank


def test_a_run_job_logs_into_the_active_run_of_the_configured_store(
        client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"file://{tmp_path}/mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(4_000, 8)).astype("float32")
    y = (X[:, 0] > 0).astype("int64")
    tracker = dt.callbacks.MLflow()
    with mlflow.start_run(run_name="mine") as active:  # in the store MLFLOW_TRACKING_URI names
        mlflow.log_param("owner", "me")
        result = dt.run(count_up, workers=2, client=client, data={"train": (X, y)},
                        config={"lr": 0.2}, callbacks=[tracker],
                        checkpoint=dt.CheckpointConfig(tmp_path / "ck", keep=2))
        assert mlflow.active_run().info.run_id == active.info.run_id  # left running
        assert mlflow.MlflowClient().get_run(active.info.run_id).info.status == "RUNNING"
    assert tracker.run_id == active.info.run_id
    reader = mlflow.MlflowClient(tracking_uri=uri)
    run = reader.get_run(active.info.run_id)
    assert run.data.params["owner"] == "me" and run.data.params["lr"] == "0.2"
    assert run.data.params["run.workers"] == "2" and run.data.params["run.seed"] == "0"
    assert len(result.history) == 3
    assert history_of(reader, run.info.run_id, "epoch_done") == \
        recorded(result.history, "epoch_done")
    newest = Path(result.checkpoint).name
    files = {a.path for a in reader.list_artifacts(run.info.run_id, f"checkpoint/{newest}")}
    assert files == {f"checkpoint/{newest}/{p.name}" for p in Path(result.checkpoint).iterdir()}
    assert f"checkpoint/{newest}/manifest.json" in files
    assert not math.isnan(run.data.metrics["loss"])


def test_bad_arguments_are_refused_all_at_once() -> None:
    with pytest.raises(dt.InvalidInput) as info:
        dt.callbacks.MLflow(experiment="", tracking_uri=3, log_model="yes")
    text = str(info.value)
    assert "experiment=''" in text and "tracking_uri=3" in text and "log_model='yes'" in text


# -- a job that raises: the run ends FAILED (KILLED on Ctrl-C), with what the job had --------------
class EvalBomb(torch.nn.Module):
    """Trains; raises when the scorer evaluates it (eval mode, the whole validation set). The
    Trainer's probe (a couple of rows) passes."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(64, 10)

    def forward(self, x):
        if not self.training and len(x) > 100:
            raise ValueError("boom in the scorer")
        return self.net(x)


def test_a_trainer_whose_scorer_raises_ends_its_run_failed(client, tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/mlruns"
    X, y = dt.datasets.digits(n_samples=4_000)
    Xv, yv = dt.datasets.digits(n_samples=300, seed=7)
    tracker = dt.callbacks.MLflow(experiment="bombs", tracking_uri=uri)
    trainer = dt.Trainer(EvalBomb(), workers=2, batch_size=64, epochs=50, score_every=0.2,
                         timeout=60, progress=False, callbacks=[tracker], client=client,
                         failure=dt.FailureConfig(max_failures=0))
    with pytest.raises(Exception) as info:
        trainer.fit(X, y, validation=(np.asarray(Xv), np.asarray(yv)))
    assert "boom in the scorer" in str(info.value)
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(tracker.run_id)
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert "boom in the scorer" in run.data.tags["dask_train.error"]
    assert run.data.params["epochs"] == "50"  # what it had: its parameters


def fails_at_third_report(ctx, epochs=10):
    net = ctx.prepare(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for epoch in ctx.epochs(epochs):
        for xb, yb in ctx.batches():
            opt.zero_grad()
            F.cross_entropy(net(xb), yb).backward()
            opt.step()
        if epoch == 2:
            raise RuntimeError(f"rank {ctx.rank} gave up at epoch {epoch}")
        ctx.report({"epoch_done": epoch},
                   checkpoint={"net": net.module.state_dict(), "epoch": epoch})


def test_a_failed_run_job_logs_its_scores_and_checkpoint_and_ends_only_its_own_run(
        client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"file://{tmp_path}/mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(2_000, 8)).astype("float32")
    y = (X[:, 0] > 0).astype("int64")
    job = dict(workers=2, client=client, data={"train": (X, y)}, timeout=60)
    tracker = dt.callbacks.MLflow(run_name="gives-up")
    with pytest.raises(dt.RoleFailed, match="gave up at epoch 2"):
        dt.run(fails_at_third_report, callbacks=[tracker],
               checkpoint=dt.CheckpointConfig(tmp_path / "ck", keep=1), **job)
    reader = mlflow.MlflowClient(tracking_uri=uri)
    run = reader.get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    assert "RoleFailed" in run.data.tags["dask_train.error"]
    assert "gave up at epoch 2" in run.data.tags["dask_train.error"]
    # Every score it reported, and its newest checkpoint (epoch 1's).
    assert [v for _, v in history_of(reader, run.info.run_id, "epoch_done")] == [0.0, 1.0]
    [newest] = [p for p in (tmp_path / "ck").iterdir() if p.name.startswith("ckpt-")]
    files = {a.path for a in reader.list_artifacts(run.info.run_id, f"checkpoint/{newest.name}")}
    assert f"checkpoint/{newest.name}/manifest.json" in files

    # A run the user opened is the user's to end: tagged, left RUNNING while the job's error
    # goes through the user's code.
    mine = dt.callbacks.MLflow()
    with mlflow.start_run(run_name="mine") as active:
        with pytest.raises(dt.RoleFailed):
            dt.run(fails_at_third_report, callbacks=[mine], **job)
        assert reader.get_run(active.info.run_id).info.status == "RUNNING"
    assert mine.run_id == active.info.run_id
    run = reader.get_run(active.info.run_id)
    assert run.info.status == "FINISHED"  # ended by the user's own with-block
    assert "gave up at epoch 2" in run.data.tags["dask_train.error"]


class Interrupt(dt.Callback):
    """Presses Ctrl-C (SIGINT to this process) at the job's second score."""

    def __init__(self) -> None:
        self.scores = 0

    def on_score(self, record):
        self.scores += 1
        if self.scores == 2:
            os.kill(os.getpid(), signal.SIGINT)


def reports_slowly(ctx, reports=200):
    for i in range(reports):
        time.sleep(0.05)
        ctx.report({"i": i})
        if ctx.should_stop():
            break


def test_ctrl_c_ends_the_run_killed(client, tmp_path: Path, ctrl_c: None) -> None:
    uri = f"file://{tmp_path}/mlruns"
    tracker = dt.callbacks.MLflow(tracking_uri=uri)
    with pytest.raises(KeyboardInterrupt):
        dt.run(reports_slowly, workers=2, client=client, timeout=60,
               callbacks=[tracker, Interrupt()])
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(tracker.run_id)
    assert run.info.status == "KILLED"
    assert [m.value for m in mlflow.MlflowClient(tracking_uri=uri).get_metric_history(
        run.info.run_id, "i")][:2] == [0.0, 1.0]
    # The interrupted job lets go of its workers: the next job runs on both.
    deadline = time.monotonic() + 30
    while client.run_on_scheduler(_ranks_running) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not client.run_on_scheduler(_ranks_running)


def _ranks_running(dask_scheduler) -> list[str]:
    return [str(k) for k, ts in dask_scheduler.tasks.items()
            if ts.state == "processing" and str(k).startswith("dt-")]
