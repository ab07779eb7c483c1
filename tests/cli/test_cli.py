"""``dask-train demo``: the command ``make demo`` runs, on its own embedded cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file

from dask_train.cli.main import main


def test_demo_writes_the_four_files(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dask_train.cli.main",
            "demo",
            "--n-samples",
            "100000",
            "--out",
            str(out),
            "--no-progress",
            "--seconds",
            "90",
            "--checkpoint",
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "history.csv",
        "model.safetensors",
        "scores.png",
        "summary.json",
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert {"accuracy", "steps", "samples", "samples_per_s", "wall_s", "stopped_by"} <= set(summary)
    assert summary["stopped_by"] in ("StopAtScore(accuracy>=0.95)", "StopAfter(90s)", "epochs=5")
    assert summary["steps"] > 0 and summary["samples"] > 0
    history = pd.read_csv(out / "history.csv")
    assert history["accuracy"].iloc[-1] == summary["accuracy"]
    # A score every 0.05 s: the plot shows training, not the two or three points of a run that
    # reaches its target in 0.6 s (at 0.2 s a run here had 3 rows).
    assert len(history) >= 4, history
    assert summary["strategy"] in ("async-ps", "sync", "one-process")  # the summary says which
    state = load_file(out / "model.safetensors")
    net = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))
    net.load_state_dict(state)
    assert (out / "scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "accuracy" in proc.stdout and "stopped_by" in proc.stdout
    # The final checkpoint: its manifest records the servers' step.
    # Sorted: directory names carry the step, and glob's order is the file system's.
    manifests = sorted((tmp_path / "ckpt").glob("ckpt-*/manifest.json"))
    assert manifests and json.loads(manifests[-1].read_text())["step"] == summary["steps"]


def test_demo_rejects_bad_arguments(capsys) -> None:
    assert main(["demo", "--n-samples", "0", "--target", "2"]) == 2
    err = capsys.readouterr().err
    assert "--n-samples=0 is invalid" in err and "--target=2.0 is invalid" in err
    assert main(["demo", "--resume"]) == 2
    assert "--resume needs --checkpoint" in capsys.readouterr().err
