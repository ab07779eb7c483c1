"""``dask-train train|search|predict CONFIG.yaml`` as a user runs them, against the session cluster
(``--scheduler``), and a config with mistakes refused as a whole before any work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from distributed import Client

import dask_train as dt
from dask_train.checkpoint import load_module, save_module
from dask_train.cli.main import main

MODELS = '''
import torch

def make_net(hidden=16):
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


class OwnNet(torch.nn.Module):
    """A class of the user's own file: the workers cannot import mymodels, so it travels by value."""

    def __init__(self, hidden=16):
        super().__init__()
        self.body = torch.nn.Linear(64, hidden)
        self.head = torch.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def make_weight_normed(hidden=16):
    return torch.nn.Sequential(
        torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(64, hidden)), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10))
'''

CONFIG = '''
model:
  factory: mymodels:make_net
  args: {{hidden: 16}}
  weights: {weights}
data:
  train: {{X: data/X.npy, y: data/y.npy}}
  validation: {{X: data/Xv.npy, y: data/yv.npy}}
  predict: {{X: data/Xv.npy}}
  chunk_rows: 500
trainer: {{lr: 0.003, workers: 1, ps: 1, epochs: 1, batch_size: 64, score_every: 0.5}}
stop: {{seconds: 120}}
search:
  space:
    lr: {{loguniform: [1.0e-3, 1.0e-2]}}
    hidden: [8, 16]
  n_trials: 2
  pruner: null
predict: {{output: predictions.npy, method: argmax}}
out: {out}
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "mymodels.py").write_text(MODELS)
    data = tmp_path / "data"
    data.mkdir()
    X, y = dt.datasets.digits_train()
    Xv, yv = dt.datasets.digits_test()
    for name, value in {"X": X[:2_000], "y": y[:2_000], "Xv": Xv, "yv": yv}.items():
        np.save(data / f"{name}.npy", value)
    table = pd.DataFrame(Xv, columns=[f"f{i}" for i in range(64)])
    table["label"] = yv
    table.to_parquet(data / "table.parquet")
    return tmp_path


def _config(project: Path, name: str, *, out: str,
            weights: str = "runs/digits/train/model.safetensors") -> Path:
    path = project / f"{name}.yaml"
    path.write_text(CONFIG.format(out=out, weights=weights))
    return path


@pytest.mark.timeout(300)
def test_train_then_predict_then_search(project: Path, client: Client,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    # One config for the three commands, as docs/prediction-and-search.md runs them: each
    # writes into its own subdirectory of out, and predict reads the weights train wrote.
    address = client.scheduler.address
    config = _config(project, "run", out="runs/digits")
    assert main(["train", str(config), "--scheduler", address, "--no-progress"]) == 0
    run = project / "runs" / "digits" / "train"
    assert {"summary.json", "history.csv", "scores.png", "model.safetensors", "config.yaml"} <= \
        {p.name for p in run.iterdir()}
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "epochs=1" and summary["accuracy"] > 0.3
    # The config names no strategy: the command's default, "auto", chose one and says which.
    assert summary["strategy"] in ("one-process", "sync", "async-ps")

    assert main(["predict", str(config), "--scheduler", address]) == 0
    predicted = project / "runs" / "digits" / "predict"
    labels = np.load(predicted / "predictions.npy")
    net = load_module(torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(),
                                          torch.nn.Linear(16, 10)), run / "model.safetensors")
    Xv = np.load(project / "data" / "Xv.npy").astype(np.float32)
    expected = net(torch.from_numpy(Xv)).argmax(dim=1).numpy()
    np.testing.assert_array_equal(labels, expected)
    # Train's summary is still train's; predict's is its own.
    assert json.loads((run / "summary.json").read_text()) == summary
    assert json.loads((predicted / "summary.json").read_text())["rows"] == len(Xv)
    # A table in, a table out: the feature columns of a parquet file, predictions as parquet.
    config.write_text(config.read_text()
                      .replace("predict: {X: data/Xv.npy}",
                               "predict: {X: data/table.parquet, columns: "
                               f"[{', '.join(f'f{i}' for i in range(64))}]}}")
                      .replace("output: predictions.npy", "output: predictions.parquet"))
    assert main(["predict", str(config), "--scheduler", address]) == 0
    table = pd.read_parquet(predicted / "predictions.parquet")
    np.testing.assert_array_equal(table["prediction"].to_numpy(), expected)

    assert main(["search", str(config), "--scheduler", address, "--no-progress"]) == 0
    found = project / "runs" / "digits" / "search"
    trials = pd.read_csv(found / "trials.csv")
    assert len(trials) == 2 and set(trials["state"]) == {"complete"}
    assert {"search.png", "summary.json", "model.safetensors", "best_history.csv"} <= \
        {p.name for p in found.iterdir()}
    best = json.loads((found / "summary.json").read_text())
    assert best["best_score"] == trials["score"].max()
    assert "best_score" in capsys.readouterr().out
    assert json.loads((run / "summary.json").read_text()) == summary


def test_predict_refuses_missing_or_mismatched_weights_before_any_work(
        project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # No scheduler is given and none is started: the check refuses before any cluster exists.
    config = _config(project, "predict", out="runs/digits", weights="null")
    assert main(["predict", str(config)]) == 2
    err = capsys.readouterr().err
    assert "model.weights is missing: predict needs trained weights" in err, err
    assert "runs/digits/train/model.safetensors" in err
    assert not (project / "runs").exists()
    # Weights of another model: hidden=8 in the file, 16 in the config's model section.
    weights = project / "other.safetensors"
    save_module(torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 10)), weights)
    config = _config(project, "predict", out="runs/digits", weights="other.safetensors")
    assert main(["predict", str(config)]) == 2
    err = capsys.readouterr().err
    assert "model.weights='other.safetensors' does not match model.factory='mymodels:make_net'" \
        in err, err
    assert "0.weight is [8, 64] in the file, [16, 64] in the model" in err
    # Other keys: a bare Linear's weight and bias.
    save_module(torch.nn.Linear(64, 10), weights)
    assert main(["predict", str(config), "--check"]) == 2
    err = capsys.readouterr().err
    assert "missing ['0.weight', '0.bias', '2.weight', '2.bias']" in err, err
    assert "not in the model ['bias', 'weight']" in err
    config = _config(project, "predict", out="runs/digits", weights="runs/nothing.safetensors")
    assert main(["predict", str(config), "--check"]) == 2
    assert "model.weights='runs/nothing.safetensors' does not exist" in capsys.readouterr().err
    assert not (project / "runs").exists()


def test_a_config_with_mistakes_is_refused_with_every_problem(
        project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = project / "bad.yaml"
    path.write_text(
        "model: {factory: mymodels:no_such_net}\n"
        "data: {train: {X: data/missing.npy, y: data/y.npy}, chunk_rows: 0}\n"
        "trainer: {learning_rate: 0.1}\n"
        "search: {space: {lr: {gaussian: [0, 1]}}}\n"
        "extra: 1\n"
    )
    assert main(["search", str(path), "--check"]) == 2
    err = capsys.readouterr().err
    assert "extra: unknown section" in err
    path.write_text(path.read_text().replace("extra: 1\n", ""))
    assert main(["search", str(path), "--check"]) == 2
    err = capsys.readouterr().err
    for expected in ("model.factory='mymodels:no_such_net' does not import",
                     "data.train.X='data/missing.npy' does not exist", "data.validation is missing",
                     "data.chunk_rows=0", "trainer.learning_rate: not a dt.Trainer argument",
                     "search.space.lr"):
        assert expected in err, err


def test_help_shows_an_example_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "example config:" in out and "factory: mymodels:make_net" in out
    # Predict with the example reads what train writes with it (out/train/model.safetensors).
    assert "weights: runs/digits/train/model.safetensors" in out and "out: runs/digits" in out


@pytest.mark.parametrize("factory", ["OwnNet", "make_weight_normed"])
def test_train_models_of_the_users_own_file(project: Path, client: Client, factory: str) -> None:
    # A class defined in mymodels.py, and a weight-normed layer (it cannot be pickled: it
    # travels as its factory); the workers cannot import mymodels.
    config = _config(project, f"train-{factory}", out=f"runs/{factory}")
    config.write_text(config.read_text().replace("factory: mymodels:make_net",
                                                 f"factory: mymodels:{factory}"))
    assert main(["train", str(config), "--scheduler", client.scheduler.address,
                 "--no-progress"]) == 0
    summary = json.loads((project / "runs" / factory / "train" / "summary.json").read_text())
    assert summary["stopped_by"] == "epochs=1" and summary["accuracy"] > 0.3
