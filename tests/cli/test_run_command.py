"""``dask-train run module:function CONFIG.yaml`` as a user runs it: a file of their own, a YAML
config, a subprocess with the embedded cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

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
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["returns"] == ["0", "1"] and summary["epochs_completed"] == 2
    assert summary["stopped_by"] == "trainers ended"
    assert len((tmp_path / "out" / "history.csv").read_text().splitlines()) == 3
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
