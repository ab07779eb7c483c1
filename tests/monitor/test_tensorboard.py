"""dt.callbacks.TensorBoard without a cluster: what it writes for the controller's calls, read
back with TensorBoard's own reader; and its argument checks. (A real job's files are checked in
``test_watch.py``.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _tensorboard_read import read_scalars

import dask_train as dt


def test_bad_arguments_are_refused_all_at_once() -> None:
    with pytest.raises(dt.InvalidInput) as info:
        dt.callbacks.TensorBoard("", flush_secs=0)
    message = str(info.value)
    assert "log_dir=''" in message and "flush_secs=0" in message


def test_scores_and_per_role_figures_are_written_per_fit(tmp_path: Path) -> None:
    cb = dt.callbacks.TensorBoard(tmp_path / "run", flush_secs=60)
    for fit in range(2):  # two fits: two event files in the same directory
        cb.on_fit_start({"rows": 100})
        for i in range(1, 4):
            cb.on_score({"time_s": i, "step": 100 * i + fit, "epoch": i / 4, "samples": 128 * i,
                         "accuracy": 0.5 + i / 10, "loss": 1.0 / i, "f1": math.nan,
                         "samples_per_s": math.nan if i == 1 else 1000.0 * i})
            cb.on_stats({"kind": "stats", "role": "trainer", "index": 1, "step": 100 * i,
                         "interval_s": 2.0, "samples": 4000, "feed_wait_s": 0.5,
                         "server_wait_s": 3.0})
            cb.on_stats({"kind": "stats", "role": "ps", "index": 0, "step": 100 * i,
                         "interval_s": 0.5, "updates": 50})
        cb.on_fit_end(None)
    assert len(list((tmp_path / "run").glob("events.out.tfevents.*"))) == 2
    scalars = read_scalars(tmp_path / "run")
    assert scalars["score/loss"] == [(100 * i + fit, pytest.approx(1.0 / i))
                                     for fit in range(2) for i in range(1, 4)]
    assert [v for _, v in scalars["score/accuracy"]] == pytest.approx([0.6, 0.7, 0.8] * 2)
    assert "score/f1" not in scalars  # a NaN placeholder of a metric the model does not have
    assert [v for _, v in scalars["train/samples_per_s"]] == [2000.0, 3000.0] * 2
    assert [v for _, v in scalars["train/epoch"]] == [0.25, 0.5, 0.75] * 2
    assert {v for _, v in scalars["trainer/1/samples_per_s"]} == {2000.0}
    assert {v for _, v in scalars["trainer/1/wait_data"]} == {0.25}
    assert {v for _, v in scalars["trainer/1/wait_servers"]} == {1.0}  # capped at the interval
    assert {v for _, v in scalars["ps/0/updates_per_s"]} == {100.0}
    assert not any(tag.startswith("score/samples") or tag == "score/epoch" for tag in scalars)
