"""Tests of run reports: the history table, its PNG, the summary table and the run directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest
import torch

from dask_train.checkpoint import load_module
from dask_train.errors import InvalidInput
from dask_train.report import (
    HISTORY_COLUMNS,
    history_frame,
    plot_history,
    summary_table,
    write_run,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records(n: int = 20) -> list[dict[str, float]]:
    return [
        {
            "time_s": 0.5 * i,
            "step": 100 * i,
            "epoch": i // 10,
            "samples": 12_800 * i,
            "accuracy": 0.5 + 0.45 * (1 - math.exp(-i / 5)),
            "loss": 2.0 * math.exp(-i / 6),
            "samples_per_s": 25_000.0 + i,
        }
        for i in range(n)
    ]


def test_history_columns_come_first_in_order_and_rows_sort_by_time() -> None:
    records = [
        {"loss": 0.5, "time_s": 3.0, "lr": 0.01},
        {"time_s": 1.0, "accuracy": 0.8, "worker": "w-1"},
        {"time_s": 2.0, "step": 10, "lr": 0.02},
    ]

    frame = history_frame(records)

    assert list(frame.columns) == [*HISTORY_COLUMNS, "lr", "worker"]
    assert frame["time_s"].tolist() == [1.0, 2.0, 3.0]
    assert frame["lr"].isna().tolist() == [True, False, False]
    assert frame["epoch"].isna().all()
    assert frame.loc[2, "loss"] == 0.5
    assert frame.index.tolist() == [0, 1, 2]


def test_history_ties_keep_arrival_order_and_missing_times_go_last() -> None:
    records = [{"time_s": 1.0, "step": 1}, {"step": 9}, {"time_s": 1.0, "step": 2}]

    frame = history_frame(records)

    assert frame["step"].tolist() == [1, 2, 9]


def test_empty_history_has_the_columns() -> None:
    frame = history_frame([])

    assert list(frame.columns) == list(HISTORY_COLUMNS)
    assert len(frame) == 0


def test_history_rejects_records_that_are_not_mappings() -> None:
    with pytest.raises(InvalidInput) as info:
        history_frame([{"time_s": 1.0}, 3, "x"])  # type: ignore[list-item]

    assert [p.split(" is")[0] for p in info.value.problems] == ["records[1]", "records[2]"]


def test_plot_history_writes_a_png_without_touching_pyplot(tmp_path: Path) -> None:
    backend = matplotlib.get_backend()
    path = tmp_path / "plots" / "scores.png"

    written = plot_history(history_frame(_records()), path)

    assert written == path
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000
    assert matplotlib.get_backend() == backend


@pytest.mark.parametrize(
    "records",
    [
        [{"time_s": 1.0, "loss": 0.9}, {"time_s": 2.0, "loss": 0.7}],  # no accuracy at all
        [{"time_s": 1.0, "loss": 0.9, "accuracy": float("nan")}],  # accuracy all NaN
        [{"time_s": 1.0, "accuracy": 0.9}],  # no loss
        [],
    ],
    ids=["loss-only", "accuracy-nan", "accuracy-only", "empty"],
)
def test_plot_history_handles_partial_histories(tmp_path: Path, records: list[dict]) -> None:
    path = plot_history(history_frame(records), tmp_path / "scores.png")

    assert path.read_bytes().startswith(PNG_MAGIC)


def test_plot_history_needs_time(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="time_s"):
        plot_history(pd.DataFrame({"loss": [1.0]}), tmp_path / "scores.png")


def test_summary_table_formats_values() -> None:
    table = summary_table(
        {
            "accuracy": 0.971234,
            "samples_per_s": 123456.78,
            "samples": 1_100_000,
            "lr": 0.001,
            "time_s": 61.23456,
            "strategy": "async-ps",
            "stopped_by": None,
            "converged": True,
            "final_loss": np.float32(0.123456),
        }
    )

    lines = table.splitlines()
    assert len(lines) == 9
    assert lines[0].split() == ["accuracy", "0.9712"]
    assert lines[1].split() == ["samples_per_s", "123,456.8"]
    assert lines[2].split() == ["samples", "1,100,000"]
    assert lines[3].split() == ["lr", "0.001"]
    assert lines[4].split() == ["time_s", "61.23"]
    assert lines[5].split() == ["strategy", "async-ps"]
    assert lines[6].split() == ["stopped_by", "-"]
    assert lines[7].split() == ["converged", "yes"]
    assert lines[8].split() == ["final_loss", "0.1235"]
    # Values start in one aligned column.
    assert len({line.index(line.split()[1], len(line.split()[0])) for line in lines}) == 1


def test_summary_table_of_nothing_is_empty() -> None:
    assert summary_table({}) == ""


def test_write_run_writes_four_files_that_read_back(tmp_path: Path) -> None:
    history = history_frame(_records())
    summary = {"accuracy": np.float64(0.95), "steps": np.int64(1_900), "strategy": "sync"}
    module = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    out_dir = tmp_path / "runs" / "first"

    paths = write_run(out_dir, history=history, summary=summary, module=module)

    assert set(paths) == {"summary", "history", "scores", "model"}
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "history.csv",
        "model.safetensors",
        "scores.png",
        "summary.json",
    ]
    text = paths["summary"].read_text()
    assert json.loads(text) == {"accuracy": 0.95, "steps": 1900, "strategy": "sync"}
    assert text.index('"accuracy"') < text.index('"steps"') < text.index('"strategy"')
    assert '\n  "accuracy"' in text
    pd.testing.assert_frame_equal(pd.read_csv(paths["history"]), history, check_dtype=False)
    assert paths["scores"].read_bytes().startswith(PNG_MAGIC)
    restored = load_module(
        torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10)), paths["model"]
    )
    torch.testing.assert_close(restored[0].weight, module[0].weight)


def test_write_run_writes_nan_as_null(tmp_path: Path) -> None:
    paths = write_run(
        tmp_path,
        history=history_frame([]),
        summary={"accuracy": float("nan"), "scores": [1.0, float("inf")]},
        module=torch.nn.Linear(2, 2),
    )

    assert json.loads(paths["summary"].read_text()) == {"accuracy": None, "scores": [1.0, None]}
