"""Checkpoints and exact resume: an interrupted run, resumed, equals an uninterrupted one."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt
from dask_train.checkpoint import CheckpointStore, load_shard

sys.path.insert(0, str(Path(__file__).parents[1] / "engines"))
from _models import Slow, mlp  # noqa: E402


def _data(n: int = 3000, chunks: int = 500, n_in: int = 8, n_out: int = 3):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, n_in)).astype(np.float32)
    y = (x @ rng.normal(size=(n_in, n_out))).argmax(axis=1)
    return da.from_array(x, chunks=(chunks, n_in)), da.from_array(y, chunks=chunks), x, y


def _trainer(client: Client, path: Path | None, steps: int, model: torch.nn.Module | None = None,
             **kw) -> dt.Trainer:
    options = dict(
        lr=1e-2, optimizer="adam", ps=1, workers=1, scorer=0, batch_size=32, epochs=3,
        prefetch=0, shuffle=True, seed=3, stop=[dt.StopAtStep(steps)], progress=False,
        timeout=30, client=client,
        checkpoint=None if path is None else dt.CheckpointConfig(str(path), every_seconds=None,
                                                                   every_steps=None, keep=5),
    )
    options.update(kw)
    return dt.Trainer(mlp(8, 16, 3) if model is None else model, **options)


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_resume_after_a_stop_equals_an_uninterrupted_run(
    client: Client, tmp_path: Path, strategy: str
) -> None:
    X, Y, _, _ = _data()
    # One trainer (one rank): with two, which blocks a trainer steals at an epoch's end depends
    # on timing, so two uninterrupted runs already differ; resume itself keeps the assignment.
    workers = 1
    # 130 steps: mid-epoch (94 steps per epoch with one trainer) and mid-block.
    first = _trainer(client, tmp_path, 130, strategy=strategy, workers=workers).fit(X, Y)
    resumed = _trainer(client, tmp_path, 260, strategy=strategy, workers=workers).fit(
        X, Y, resume=True
    )
    straight = _trainer(client, None, 260, strategy=strategy, workers=workers).fit(X, Y)
    assert first.steps == 130 and resumed.steps == 260 and straight.steps == 260
    assert resumed.samples == straight.samples
    torch.testing.assert_close(_flat(resumed.model), _flat(straight.model), rtol=0, atol=1e-6)
    # The first run's final checkpoint is what the second started from.
    store = CheckpointStore(dt.CheckpointConfig(str(tmp_path)))
    steps = [json.loads((Path(d) / "manifest.json").read_text())["step"] for d in store.complete()]
    assert steps == [130, 260]


def test_resume_from_a_mid_run_checkpoint(client: Client, tmp_path: Path) -> None:
    X, Y, _, _ = _data()
    config = dt.CheckpointConfig(str(tmp_path), every_seconds=None, every_steps=40, keep=10)
    run = _trainer(client, tmp_path, 200, checkpoint=config).fit(X, Y)
    assert run.steps == 200
    written = [c for c in run.checkpoints if not c.get("final")]
    assert written, "no checkpoint was taken during the run"
    store = CheckpointStore(config)
    manifests = {d: json.loads((Path(d) / "manifest.json").read_text()) for d in store.complete()}
    mid = [d for d, m in manifests.items() if 0 < m["step"] < 200]
    assert mid
    # Keep only the first mid-run checkpoint: resume must start there.
    keep = min(mid, key=lambda d: manifests[d]["step"])
    for d in store.complete():
        if d != keep:
            shutil.rmtree(d)
    step = manifests[keep]["step"]
    shard = load_shard(str(Path(keep) / "shard-0.safetensors"))
    assert shard.param.numel() == sum(p.numel() for p in mlp(8, 16, 3).parameters())
    resumed = _trainer(client, tmp_path, 200, checkpoint=config).fit(X, Y, resume=True)
    straight = _trainer(client, None, 200).fit(X, Y)
    assert resumed.steps == straight.steps == 200
    assert step < 200
    torch.testing.assert_close(_flat(resumed.model), _flat(straight.model), rtol=0, atol=1e-6)


def test_checkpoints_keep_the_newest_and_resume_needs_a_path(client: Client, tmp_path: Path) -> None:
    X, Y, _, _ = _data()
    config = dt.CheckpointConfig(str(tmp_path), every_seconds=None, every_steps=20, keep=2)
    # Paced (20 ms a batch, a sleep): the controller looks at the step count between its
    # events, and at full speed on a doubly loaded machine (two suites at once) the job ran
    # from step 48 to its end at 150 between two looks (two checkpoints, none to drop).
    run = _trainer(client, tmp_path, 150, Slow(mlp(8, 16, 3), 0.02), checkpoint=config).fit(X, Y)
    assert len(run.checkpoints) >= 3
    store = CheckpointStore(config)
    assert len(store.complete()) == 2
    assert all(math.isfinite(c["write_s"]) for c in run.checkpoints)
    with pytest.raises(dt.InvalidInput, match="resume=True needs checkpoints"):
        _trainer(client, None, 10).fit(X, Y, resume=True)


def test_on_nan_skip_leaves_bad_batches_out_and_stop_names_the_step(client: Client) -> None:
    _, _, x, y = _data(n=2000)
    x = x.copy()
    x[700] = np.nan  # one poisoned row: every epoch, one batch has a NaN loss
    X, Y = da.from_array(x, chunks=(500, 8)), da.from_array(y, chunks=500)
    skip = _trainer(client, None, 10_000, on_nan="skip", epochs=2, stop=[]).fit(X, Y)
    assert len(skip.nonfinite) == 2  # once per epoch
    assert skip.epochs_completed == 2
    assert torch.isfinite(_flat(skip.model)).all()
    stop = _trainer(client, None, 10_000, on_nan="stop", epochs=2, stop=[]).fit(X, Y)
    assert "non-finite loss" in stop.stopped_by and "trainer-0" in stop.stopped_by
    assert stop.epochs_completed == 0
    assert torch.isfinite(_flat(stop.model)).all()
