"""``dask-train bench``: the grid on the embedded cluster, its table, CSV, plot and refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dask_train.cli.main import main


def test_bench_measures_the_grid_and_writes_table_csv_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "dask_train.cli.main", "bench", "--workers", "1,2", "--ps", "1",
         "--model", "64-16-10", "--seconds", "1", "--n-samples", "20000", "--out", str(out)],
        capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "bench.csv", "bench.json", "bench.md", "bench.png"]
    rows = pd.read_csv(out / "bench.csv")
    assert list(zip(rows["workers"], rows["ps"])) == [(1, 1), (2, 1)]
    assert (rows["samples_per_s"] > 0).all() and (rows["steps_per_s"] > 0).all()
    assert rows["predicted_samples_per_s"].gt(0).all() and rows["calibration_point"].all()
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "bench.json").read_text())
    assert saved["groups"][0]["probed"]["n_params"] == 64 * 16 + 16 + 16 * 10 + 10
    # The printed tables: the measured points, and the recommendation up to 1,000 workers.
    assert "| 64-16-10 | 1,210 | 1 | 1 |" in proc.stdout
    assert "recommended ps" in proc.stdout and "| 1000 |" in proc.stdout
    assert "dask-train bench" in proc.stderr  # the progress bar
    assert "Traceback" not in proc.stderr and "ERROR" not in proc.stderr


def test_bench_refuses_bad_options_before_starting_anything(capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    code = main(["bench", "--workers", "0,2", "--model", "64-x-10", "--link-rate", "100",
                 "--scheduler", "tcp://10.0.0.1:8786", "--n-samples", "0"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--link-rate=[100.0] with --scheduler='tcp://10.0.0.1:8786'" in err
    assert "workers=[0, 2] is invalid" in err
    assert "model '64-x-10' is invalid" in err
    assert "--n-samples=0 is invalid" in err
