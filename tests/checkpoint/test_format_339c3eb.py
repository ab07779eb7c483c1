"""Checkpoints written by commit 339c3eb still resume with today's code.

339c3eb is the commit before the refactor of the job spec, the settings and the manifest's
"config" part of ``dt.run`` jobs. The fixtures under ``fixtures/v339c3eb/`` were written by
``fixtures/make_fixtures.py --out tests/checkpoint/fixtures/v339c3eb --cases async_ps sync run``
with that commit's code (its docstring says how): a 64-16-10 MLP with Adam on
``dt.datasets.digits(2000)``, trained 12 steps by Trainer jobs with async parameter servers (2
shards) and with sync all-reduce, and 2 epochs by a ``dt.run`` job of ``make_fixtures.run_train``
that reports a checkpoint each epoch; each run's final checkpoint kept.

Resuming from a copy of each (``resume=True``) must start from its step and its saved tensors
and train on from there; for the ``dt.run`` job, ``ctx.restore()`` must give every rank the state
as it was reported, and the step, the epochs and the history must go on from the checkpoint's.
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
from dask_train.checkpoint import CheckpointStore, load_state, read_slice

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import make_fixtures as fixtures  # noqa: E402

FIXTURES = fixtures.HERE / "v339c3eb"


@pytest.fixture
def fixture_root() -> Path:
    """The folder of the commit's fixtures (test_format_abda228.py reuses these tests with its own)."""
    return FIXTURES


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _copy(root: Path, name: str, tmp_path: Path) -> tuple[dt.CheckpointConfig, CheckpointStore,
                                                         str, dict[str, Any]]:
    """A copy of the fixture (resume writes beside it), its store, checkpoint and manifest."""
    shutil.copytree(root / name, tmp_path / name)
    config = dt.CheckpointConfig(str(tmp_path / name), every_seconds=None, every_steps=None,
                                 keep=5)
    store = CheckpointStore(config)
    [directory] = store.complete()
    return config, store, directory, store.read_manifest(directory)


def _saved_tensors(store: CheckpointStore, directory: str, manifest: dict[str, Any]) -> Any:
    files = [{"path": store.shard_path(directory, int(f["index"])), "start": f["start"],
              "stop": f["stop"]} for f in manifest["files"]]
    return read_slice(files, 0, int(manifest["n_params"]))


def _resume(client: Client, name: str, config: dt.CheckpointConfig, stop_at: int) -> dt.FitResult:
    settings, _ = fixtures.RUNS[name]
    X, y = fixtures.data()
    trainer = dt.Trainer(fixtures.mlp(), **fixtures.COMMON, **settings,
                         stop=[dt.StopAtStep(stop_at)], checkpoint=config, client=client)
    return trainer.fit(X, y, resume=True)


def _same(a: Any, b: Any, where: str = "state") -> None:
    """``a`` and ``b`` hold the same structure, values and tensors (bit for bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(map(str, a)),
                                                          sorted(map(str, b)))
        for key in a:
            _same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("name", sorted(fixtures.RUNS))
def test_a_339c3eb_checkpoint_resumes_at_its_step_with_its_tensors(client: Client, tmp_path: Path,
                                                                   fixture_root: Path,
                                                                   name: str) -> None:
    config, store, directory, manifest = _copy(fixture_root, name, tmp_path)
    saved = _saved_tensors(store, directory, manifest)
    step = int(manifest["step"])
    result = _resume(client, name, config, stop_at=step)  # resumed, then stopped at once
    assert step == fixtures.RUNS[name][1] and manifest["format"] == 1
    assert saved.optimizer_name == "Adam" and set(saved.optimizer_state) >= {"exp_avg", "exp_avg_sq"}
    assert not torch.equal(saved.param, _flat(fixtures.mlp()))  # trained: not the initial model
    assert result.steps == step and result.samples == int(manifest["samples"])
    assert torch.equal(_flat(result.model), saved.param)


@pytest.mark.parametrize("name", sorted(fixtures.RUNS))
def test_a_339c3eb_checkpoint_trains_on_from_its_step(client: Client, tmp_path: Path,
                                                      fixture_root: Path,
                                                      name: str) -> None:
    config, store, directory, manifest = _copy(fixture_root, name, tmp_path)
    saved = _saved_tensors(store, directory, manifest)
    step = int(manifest["step"])
    result = _resume(client, name, config, stop_at=step + 8)
    assert result.steps == step + 8
    assert result.samples > int(manifest["samples"])
    assert not torch.equal(_flat(result.model), saved.param)
    assert torch.isfinite(_flat(result.model)).all()
    # The resumed run's own final checkpoint continues the old one's numbering.
    assert [store.read_manifest(d)["step"] for d in store.complete()] == [step, step + 8]


def test_a_339c3eb_run_checkpoint_restores_its_state_and_goes_on(client: Client, tmp_path: Path,
                                                                 fixture_root: Path) -> None:
    config, store, directory, manifest = _copy(fixture_root, fixtures.RUN_CASE, tmp_path)
    step, last_epoch = int(manifest["step"]), fixtures.RUN_EPOCHS - 1
    saved = load_state(store.shard_path(directory, 0))  # the state as run_train reported it
    assert manifest["strategy"] == "run" and manifest["format"] == 1
    assert saved["epoch"] == last_epoch and saved["step"] == step > 0
    assert set(saved["opt"]["state"]) and isinstance(saved["opt"]["param_groups"][0]["betas"],
                                                     tuple)
    initial = fixtures.mlp().state_dict()
    assert not all(torch.equal(saved["model"][k], initial[k]) for k in initial)  # trained

    result = fixtures.run_job(client, epochs=fixtures.RUN_EPOCHS + 1, checkpoint=config,
                              resume=True)

    assert [r["rank"] for r in result.returns] == [0, 1]
    for r in result.returns:
        # ctx.restore() gives each rank the state as it was reported, tensors bit for bit ...
        _same(r["restored"], saved, f"rank {r['rank']}'s ctx.restore()")
        _same(r["start"]["params"], saved["model"], f"rank {r['rank']}'s model after the restore")
        # ... ctx.step and ctx.epochs() go on from the checkpoint's ...
        assert r["start"]["step"] == step, r["start"]["step"]
        assert r["epochs"] == [fixtures.RUN_EPOCHS]
        # ... and the rank trains on from there.
        assert r["step"] > step
        assert not all(torch.equal(r["params"][k], saved["model"][k]) for k in saved["model"])
        assert all(torch.isfinite(v).all() for v in r["params"].values())
    # The history goes on from the checkpoint's records, and the new epoch reads every row once.
    records = manifest["records"]
    history = result.history
    assert list(history["epoch"]) == [float(e) for e in range(1, fixtures.RUN_EPOCHS + 2)]
    assert list(history["step"])[:len(records)] == [rec["step"] for rec in records]
    consumed = result.ledger.groupby("epoch")["consumed"].sum()
    assert consumed.get(fixtures.RUN_EPOCHS, 0) == fixtures.ROWS, consumed.to_dict()
    # The resumed job's own checkpoint follows the old one, and holds the new epoch's state.
    steps = [int(store.read_manifest(d)["step"]) for d in store.complete()]
    assert steps[0] == step and len(steps) == 2 and steps[1] > step, steps
    newest = result.load_checkpoint()
    assert newest["epoch"] == fixtures.RUN_EPOCHS and newest["step"] == steps[1]
    _same(newest["model"], result.returns[0]["params"], "the new checkpoint's model")
