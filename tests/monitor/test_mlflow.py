"""dt.callbacks.MLflow on a real cluster, read back with MLflow's own client from its local file
store: a Trainer job's parameters, every score and the model; a dt.run job logged into the run
active where it was started, through MLFLOW_TRACKING_URI, with its newest checkpoint."""

from __future__ import annotations

import math
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
                         workers=2, batch_size=64, epochs=3, score_every=0.2, progress=False,
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
    # Every score of the history, at its step, and nothing else.
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
