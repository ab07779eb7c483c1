"""``dask-train run module:function CONFIG.yaml`` as a user runs it: a file of their own, a YAML
config, a subprocess with the embedded cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dask_train.cli.main import main

TRAIN = '''
import torch, torch.nn.functional as F

def train(ctx, lr=0.01, epochs=2):
    net = ctx.prepare(torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in ctx.epochs(epochs):
        for xb, yb in ctx.batches():
            opt.zero_grad(); loss = F.cross_entropy(net(xb), yb); loss.backward(); opt.step()
        ctx.report({"loss": loss.item()}, checkpoint={"net": net.state_dict()})
    return ctx.rank
'''


def _files(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    np.save(tmp_path / "X.npy", rng.normal(size=(3_000, 4)).astype("float32"))
    np.save(tmp_path / "y.npy", rng.integers(0, 3, 3_000))
    (tmp_path / "mytrain.py").write_text(TRAIN)
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent("""\
        config: {lr: 0.05, epochs: 2}
        data:
          train: {X: X.npy, y: y.npy}
          chunk_rows: 500
        run: {workers: 2, checkpoint: ckpt, keep: 1}
        cluster: {n_workers: 2}
        out: out
        """))
    return config


def test_run_command_trains_a_users_function_from_its_file(tmp_path: Path) -> None:
    config = _files(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "dask_train.cli.main", "run", "mytrain:train",
                           str(config)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "out" / "run"  # the command's own subdirectory of out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["returns"] == ["0", "1"] and summary["epochs_completed"] == 2
    assert summary["stopped_by"] == "trainers ended"
    assert len((run / "history.csv").read_text().splitlines()) == 3
    assert len([p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("ckpt-")]) == 1
    assert " ERROR " not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_run_command_names_every_problem_before_running(tmp_path: Path, capsys) -> None:
    config = _files(tmp_path)
    config.write_text("config: {lrr: 1}\nrun: {workerz: 2}\ndata: {train: {X: X.npy}}\n")
    assert main(["run", "mytrain:nothere", str(config)]) == 2
    err = capsys.readouterr().err
    assert "run.workerz: unknown setting" in err and "has no function 'nothere'" in err
    config.write_text("config: {lrr: 1}\ndata: {train: {X: X.npy, y: y.npy}}\n")
    assert main(["run", "mytrain:train", str(config), "--check"]) == 2
    assert "cannot be called with config={'lrr': 1}" in capsys.readouterr().err
    # resources: is dt.run's resources=, checked with its words.
    config.write_text("run: {resources: {GPU: 0}}\ndata: {train: {X: X.npy, y: y.npy}}\n")
    assert main(["run", "mytrain:train", str(config), "--check"]) == 2
    assert "resources={'GPU': 0} is invalid: GPU=0 is not" in capsys.readouterr().err


# docs/own-loop.md's function, as a user copies it into mytrain.py (its dt.run call left out).
OWN_LOOP = """
import torch
import torch.nn.functional as F

def make_net():
    return torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))

def train(ctx, lr=1e-3, epochs=5):
    model = ctx.prepare(make_net())
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    state = ctx.restore()
    if state:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    xv, yv = ctx.dataset(NAME)
    for epoch in ctx.epochs(epochs):
        for xb, yb in ctx.batches("train", batch_size=64):
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
        with torch.no_grad():
            accuracy = (model(xv).argmax(1) == yv).float().mean().item()
        ctx.report({"loss": loss.item(), "accuracy": accuracy},
                   checkpoint={"model": model.module.state_dict(), "opt": opt.state_dict()})
        if ctx.should_stop():
            break
    return ctx.rank
"""


@pytest.fixture(scope="module")
def help_example() -> str:
    """The example config ``dask-train run --help`` prints (asked once: the tests only read it)."""
    help_text = subprocess.run([sys.executable, "-m", "dask_train.cli.main", "run", "--help"],
                               capture_output=True, text=True, check=True).stdout
    return help_text.split("example config:\n\n", 1)[1]


def _own_loop(tmp_path: Path, name: str, example: str) -> Path:
    """The docs' function beside the config ``dask-train run --help`` prints, on small data."""
    import dask_train as dt

    X, y = dt.datasets.digits_train()
    Xv, yv = dt.datasets.digits_test()
    (tmp_path / "data").mkdir()
    for key, value in {"X": X[:2_000], "y": y[:2_000], "Xv": Xv, "yv": yv}.items():
        np.save(tmp_path / "data" / f"{key}.npy", value)
    (tmp_path / "mytrain.py").write_text(OWN_LOOP.replace("NAME", name))
    config = tmp_path / "run.yaml"
    config.write_text(example.replace("epochs: 5", "epochs: 1"))
    return config


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dask_train.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_the_docs_function_runs_with_the_help_config(tmp_path: Path, help_example: str) -> None:
    config = _own_loop(tmp_path, '"val"', help_example)
    assert _cli("run", "mytrain:train", str(config), "--check", cwd=tmp_path).returncode == 0
    proc = _cli("run", "mytrain:train", str(config), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "mine" / "run" / "summary.json").read_text())
    assert summary["returns"] == ["0", "1"] and summary["epochs_completed"] == 1


def test_check_names_a_data_set_the_function_asks_for_and_the_config_lacks(
        tmp_path: Path, help_example: str) -> None:
    config = _own_loop(tmp_path, '"validation"', help_example)
    proc = _cli("run", "mytrain:train", str(config), "--check", cwd=tmp_path)
    assert proc.returncode == 2 and "ok" not in proc.stdout
    assert "mytrain:train reads ctx.dataset('validation'), but the config's data has no set " \
        "'validation' (its small sets: ['val']; 'train' is streamed)" in proc.stderr, proc.stderr
    # Without --check the same refusal, before any cluster starts.
    proc = _cli("run", "mytrain:train", str(config), cwd=tmp_path)
    assert proc.returncode == 2 and "no set 'validation'" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_ranks_invalid_input_reaches_the_user_without_dasks_tracebacks(
        tmp_path: Path, help_example: str) -> None:
    # A name the check cannot read (computed): every rank raises InvalidInput; the user reads
    # dask-train's one line, not distributed's "Compute Failed" ERRORs with their tracebacks.
    config = _own_loop(tmp_path, '"va" + "lid"', help_example)
    proc = _cli("run", "mytrain:train", str(config), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "failed: InvalidInput: ctx.dataset('valid'): the job's data sets are ['val']" \
        in proc.stderr, proc.stderr[-3000:]
    assert "Compute Failed" not in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr[-3000:]
