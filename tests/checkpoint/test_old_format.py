"""Checkpoints written before the reorganisation of issue 22 still resume with today's code.

The fixtures under ``fixtures/`` were written by ``fixtures/make_fixtures.py`` with the code of
commit 5c1e3fa: a 64-16-10 MLP trained 12 steps on ``dt.datasets.digits(2000)`` with async
parameter servers (2 shards) and with sync all-reduce, each run's final checkpoint kept. Resuming
from a copy of each must start from its step and its saved tensors, and train on from there.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import Client

import dask_train as dt
from dask_train.checkpoint import CheckpointStore, read_slice

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import make_fixtures as fixtures  # noqa: E402


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _copy(name: str, tmp_path: Path) -> tuple[dt.CheckpointConfig, dict[str, Any], Any]:
    """A copy of the fixture (resume writes beside it), its manifest and its saved state."""
    shutil.copytree(fixtures.HERE / name, tmp_path / name)
    config = dt.CheckpointConfig(str(tmp_path / name), every_seconds=None, every_steps=None,
                                 keep=5)
    store = CheckpointStore(config)
    [directory] = store.complete()
    manifest = store.read_manifest(directory)
    files = [{"path": store.shard_path(directory, int(f["index"])), "start": f["start"],
              "stop": f["stop"]} for f in manifest["files"]]
    return config, manifest, read_slice(files, 0, int(manifest["n_params"]))


def _resume(client: Client, name: str, config: dt.CheckpointConfig, stop_at: int) -> dt.FitResult:
    settings, _ = fixtures.RUNS[name]
    X, y = fixtures.data()
    trainer = dt.Trainer(fixtures.mlp(), **fixtures.COMMON, **settings,
                         stop=[dt.StopAtStep(stop_at)], checkpoint=config, client=client)
    return trainer.fit(X, y, resume=True)


@pytest.mark.parametrize("name", sorted(fixtures.RUNS))
def test_an_old_checkpoint_resumes_at_its_step_with_its_tensors(client: Client, tmp_path: Path,
                                                                 name: str) -> None:
    config, manifest, saved = _copy(name, tmp_path)
    step = int(manifest["step"])
    result = _resume(client, name, config, stop_at=step)  # resumed, then stopped at once
    assert step == fixtures.RUNS[name][1] and manifest["format"] == 1
    assert saved.optimizer_name == "Adam" and set(saved.optimizer_state) >= {"exp_avg", "exp_avg_sq"}
    assert not torch.equal(saved.param, _flat(fixtures.mlp()))  # trained: not the initial model
    assert result.steps == step and result.samples == int(manifest["samples"])
    assert torch.equal(_flat(result.model), saved.param)


@pytest.mark.parametrize("name", sorted(fixtures.RUNS))
def test_an_old_checkpoint_trains_on_from_its_step(client: Client, tmp_path: Path,
                                                   name: str) -> None:
    config, manifest, saved = _copy(name, tmp_path)
    step = int(manifest["step"])
    result = _resume(client, name, config, stop_at=step + 8)
    assert result.steps == step + 8
    assert result.samples > int(manifest["samples"])
    assert not torch.equal(_flat(result.model), saved.param)
    assert torch.isfinite(_flat(result.model)).all()
    # The resumed run's own final checkpoint continues the old one's numbering.
    store = CheckpointStore(config)
    assert [store.read_manifest(d)["step"] for d in store.complete()] == [step, step + 8]
