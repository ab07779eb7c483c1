"""CheckpointConfig validation and triggers; CheckpointStore layout, completeness, newest and pruning."""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch

from dask_train.checkpoint import CheckpointConfig, CheckpointStore, save_tensors
from dask_train.errors import InvalidInput


@pytest.fixture
def memory_dir() -> Iterator[str]:
    # The memory filesystem is one store per process: give each test its own folder, then clear it.
    fs = fsspec.filesystem("memory")
    folder = f"/dask-train-store-{uuid.uuid4().hex}"
    yield f"memory://{folder}"
    if fs.exists(folder):
        fs.rm(folder, recursive=True)


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path, memory_dir: str) -> str:
    return str(tmp_path / "ckpt") if request.param == "local" else memory_dir


def _write(store: CheckpointStore, step: int, generation: int = 0, *, shards: int = 2,
           manifest: bool = True) -> str:
    directory = store.directory(step, generation)
    for i in range(shards):
        save_tensors({"param": torch.full((3,), float(step))}, store.shard_path(directory, i))
    if manifest:
        names = [os.path.basename(store.shard_path(directory, i)) for i in range(shards)]
        store.write_manifest(directory, {"shards": names, "epoch": 1})
    return directory


# -- CheckpointConfig -------------------------------------------------------------------------------
def test_config_defaults() -> None:
    config = CheckpointConfig("ckpt/")
    assert (config.every_seconds, config.every_steps, config.keep) == (30.0, None, 3)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"keep": 0}, "CheckpointConfig(keep=0): keep must be an integer >= 1"),
        ({"keep": True}, "keep=True"),
        ({"keep": 2.0}, "keep=2.0"),
        ({"every_seconds": 0}, "every_seconds=0"),
        ({"every_seconds": -1.5}, "every_seconds=-1.5"),
        ({"every_seconds": math.inf}, "every_seconds=inf"),
        ({"every_seconds": math.nan}, "every_seconds=nan"),
        ({"every_seconds": True}, "every_seconds=True"),
        ({"every_seconds": "30"}, "every_seconds='30'"),
        ({"every_steps": 0}, "every_steps=0"),
        ({"every_steps": 1.5}, "every_steps=1.5"),
        ({"every_steps": False}, "every_steps=False"),
        ({"storage_options": ["anon"]}, "storage_options=['anon']"),
        ({"path": ""}, "path=''"),
        ({"path": 3}, "path=3"),
    ],
)
def test_config_rejects(kwargs: dict, needle: str) -> None:
    args = {"path": "ckpt/", **kwargs}
    with pytest.raises(InvalidInput) as info:
        CheckpointConfig(**args)
    assert needle in str(info.value)


def test_config_lists_every_problem() -> None:
    with pytest.raises(InvalidInput) as info:
        CheckpointConfig("ckpt/", every_seconds=-1, every_steps=0, keep=0)
    assert len(info.value.problems) == 3
    assert isinstance(info.value, ValueError)


def test_config_accepts_path_like_and_no_triggers(tmp_path: Path) -> None:
    config = CheckpointConfig(tmp_path, every_seconds=None, every_steps=None, keep=1,
                              storage_options={"anon": True})
    assert not config.due(now=1e9, last_time=0, step=10**6, last_step=0)


@pytest.mark.parametrize(
    ("seconds", "steps", "now", "step", "expected"),
    [
        (30.0, None, 29.9, 50, False),
        (30.0, None, 30.0, 50, True),
        (None, 100, 1e9, 109, False),
        (None, 100, 0.0, 110, True),
        (30.0, 100, 10.0, 110, True),  # steps fire first
        (30.0, 100, 40.0, 11, True),  # time fires first
        (30.0, 100, 40.0, 10, False),  # no step since the last checkpoint: nothing to write
    ],
)
def test_due(seconds: float | None, steps: int | None, now: float, step: int, expected: bool) -> None:
    config = CheckpointConfig("ckpt/", every_seconds=seconds, every_steps=steps)
    assert config.due(now=now, last_time=0.0, step=step, last_step=10) is expected


# -- CheckpointStore --------------------------------------------------------------------------------
def test_layout_local_and_url(tmp_path: Path) -> None:
    local = CheckpointStore(CheckpointConfig(tmp_path / "run"))
    directory = local.directory(1234, 2)
    assert directory == os.path.join(str(tmp_path), "run", "ckpt-000000001234-002")
    assert local.shard_path(directory, 3) == os.path.join(directory, "shard-3.safetensors")
    remote = CheckpointStore(CheckpointConfig("memory://bucket/run1/"))
    assert remote.directory(7, 0) == "memory://bucket/run1/ckpt-000000000007-000"
    assert remote.shard_path(remote.directory(7, 0), 0).endswith("ckpt-000000000007-000/shard-0.safetensors")
    with pytest.raises(InvalidInput):
        local.directory(-1, 0)


def test_relative_local_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Trainers and servers may run with another working directory than the controller.
    monkeypatch.chdir(tmp_path)
    store = CheckpointStore(CheckpointConfig("ckpt/"))
    assert os.path.isabs(store.directory(1, 0))


def test_file_url(tmp_path: Path) -> None:
    store = CheckpointStore(CheckpointConfig(f"file://{tmp_path}/run"))
    directory = _write(store, 5)
    assert directory.startswith("file://")
    assert store.complete() == [directory]
    assert (tmp_path / "run" / "ckpt-000000000005-000" / "manifest.json").exists()


def test_write_and_read_manifest(root: str) -> None:
    store = CheckpointStore(CheckpointConfig(root))
    directory = _write(store, 10, 1)
    manifest = store.read_manifest(directory)
    assert manifest["format"] == 1
    assert manifest["shards"] == ["shard-0.safetensors", "shard-1.safetensors"]
    assert (manifest["step"], manifest["generation"], manifest["epoch"]) == (10, 1, 1)
    assert isinstance(manifest["written_at"], float)
    assert store.newest() == (directory, manifest)


def test_manifest_accepts_shard_paths_and_stores_names(root: str) -> None:
    store = CheckpointStore(CheckpointConfig(root))
    directory = store.directory(3, 0)
    path = store.shard_path(directory, 0)
    save_tensors({"p": torch.zeros(1)}, path)
    store.write_manifest(directory, {"shards": [path], "step": 99})
    manifest = store.read_manifest(directory)
    assert manifest["shards"] == ["shard-0.safetensors"]
    assert manifest["step"] == 99  # the caller's value wins over the directory's name


def test_manifest_refuses_missing_shards_and_bad_values(root: str) -> None:
    store = CheckpointStore(CheckpointConfig(root))
    directory = store.directory(3, 0)
    with pytest.raises(InvalidInput, match="write every shard before the manifest"):
        store.write_manifest(directory, {"shards": ["shard-0.safetensors"]})
    with pytest.raises(InvalidInput, match="list of the shard file names"):
        store.write_manifest(directory, {})
    with pytest.raises(InvalidInput, match="not files inside that directory"):
        store.write_manifest(directory, {"shards": ["../other/shard-0.safetensors"]})
    with pytest.raises(InvalidInput, match="not JSON-serialisable"):
        store.write_manifest(directory, {"shards": [], "tensor": torch.zeros(1)})
    assert store.complete() == []


def test_manifest_keeps_infinite_floats(root: str) -> None:
    # A stop condition's best score starts at -inf; the manifest must carry it back.
    store = CheckpointStore(CheckpointConfig(root))
    directory = store.directory(1, 0)
    store.write_manifest(directory, {"shards": [], "best": -math.inf})
    assert store.read_manifest(directory)["best"] == -math.inf


def test_complete_is_ordered_by_step_then_generation(root: str) -> None:
    store = CheckpointStore(CheckpointConfig(root, keep=10))
    made = [_write(store, s, g) for s, g in [(20, 0), (5, 1), (20, 1), (5, 0), (1000, 0)]]
    assert store.complete() == [made[3], made[1], made[0], made[2], made[4]]
    assert store.newest() is not None and store.newest()[0] == made[4]  # type: ignore[index]


def test_empty_or_missing_root(root: str) -> None:
    store = CheckpointStore(CheckpointConfig(root))
    assert store.complete() == []
    assert store.newest() is None
    assert store.prune() == []


@pytest.mark.parametrize("damage", ["no manifest", "truncated", "not json object", "wrong format",
                                    "missing shard"])
def test_kill_mid_write_leaves_the_previous_checkpoint(root: str, damage: str) -> None:
    store = CheckpointStore(CheckpointConfig(root))
    good = _write(store, 10)
    bad = _write(store, 20, manifest=damage != "no manifest")
    fs, fs_root = fsspec.core.url_to_fs(root)
    manifest_path = f"{fs_root}/ckpt-000000000020-000/manifest.json"
    if damage == "truncated":
        text = fs.cat_file(manifest_path)
        fs.pipe_file(manifest_path, text[: len(text) // 2])
    elif damage == "not json object":
        fs.pipe_file(manifest_path, b"[1, 2]")
    elif damage == "wrong format":
        fs.pipe_file(manifest_path, json.dumps({"format": 2, "shards": []}).encode())
    elif damage == "missing shard":
        fs.rm(f"{fs_root}/ckpt-000000000020-000/shard-1.safetensors")
    newest = store.newest()
    assert newest is not None
    assert newest[0] == good
    assert store.complete() == [good]
    if damage != "missing shard":
        with pytest.raises(InvalidInput, match="not completed"):
            store.read_manifest(bad)


def test_prune_keeps_newest_and_in_progress(root: str) -> None:
    store = CheckpointStore(CheckpointConfig(root, keep=2))
    c10 = _write(store, 10)
    leftover = _write(store, 15, manifest=False)  # killed mid-write, older than the newest
    c20 = _write(store, 20)
    c30 = _write(store, 30)
    writing = _write(store, 40, manifest=False)  # may be being written right now
    c30_gen1 = _write(store, 30, 1)
    deleted = store.prune()
    assert sorted(deleted) == sorted([c10, leftover, c20])
    assert store.complete() == [c30, c30_gen1]
    fs, fs_root = fsspec.core.url_to_fs(root)
    names = sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(fs_root, detail=False))
    assert names == ["ckpt-000000000030-000", "ckpt-000000000030-001", "ckpt-000000000040-000"]
    assert writing.endswith(names[-1])
    assert store.prune() == []


def test_prune_without_complete_checkpoints_deletes_nothing(root: str) -> None:
    store = CheckpointStore(CheckpointConfig(root, keep=1))
    _write(store, 10, manifest=False)
    assert store.prune() == []


def test_temporary_manifest_files_are_not_left(tmp_path: Path) -> None:
    store = CheckpointStore(CheckpointConfig(tmp_path))
    directory = _write(store, 1)
    assert sorted(os.listdir(directory)) == ["manifest.json", "shard-0.safetensors", "shard-1.safetensors"]


def test_unrelated_entries_are_ignored(tmp_path: Path) -> None:
    store = CheckpointStore(CheckpointConfig(tmp_path, keep=1))
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "ckpt-abc").mkdir()
    _write(store, 1)
    _write(store, 2)
    store.prune()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000000002-000", "ckpt-abc", "notes.txt"]
