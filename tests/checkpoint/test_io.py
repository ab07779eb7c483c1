"""Tests of safetensors checkpoints: round trips, metadata, fsspec URLs and atomic replacement."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from dask_train.checkpoint import (
    load_metadata,
    load_module,
    load_tensors,
    save_module,
    save_tensors,
)
from dask_train.errors import InvalidInput


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 10)
    )


def _assert_same_state(left: torch.nn.Module, right: torch.nn.Module) -> None:
    left_state, right_state = left.state_dict(), right.state_dict()
    assert left_state.keys() == right_state.keys()
    for name in left_state:
        torch.testing.assert_close(left_state[name], right_state[name], rtol=0, atol=0)


@pytest.fixture
def memory_dir() -> Iterator[str]:
    # The memory filesystem is one store per process: give each test its own folder, then clear it.
    fs = fsspec.filesystem("memory")
    folder = f"/dask-train-test-{uuid.uuid4().hex}"
    yield f"memory://{folder}"
    if fs.exists(folder):
        fs.rm(folder, recursive=True)


def test_mlp_round_trip(tmp_path: Path) -> None:
    trained = _mlp()
    trained(torch.randn(16, 64))  # updates the BatchNorm running statistics (buffers)
    path = tmp_path / "nested" / "dirs" / "model.safetensors"

    returned = save_module(trained, path)
    restored = load_module(_mlp(), path)

    assert returned == os.fspath(path)
    _assert_same_state(trained, restored)
    batch = torch.randn(8, 64)
    torch.testing.assert_close(trained.eval()(batch), restored.eval()(batch))


def test_metadata_round_trip_and_default(tmp_path: Path) -> None:
    tensors = {"w": torch.ones(3)}
    with_meta = save_tensors(tensors, tmp_path / "a.safetensors", metadata={"step": "12"})
    without = save_tensors(tensors, tmp_path / "b.safetensors")

    assert load_metadata(with_meta) == {"step": "12"}
    assert load_metadata(without) == {}


def test_numpy_arrays_and_non_contiguous_tensors_are_accepted(tmp_path: Path) -> None:
    array = np.arange(12, dtype=np.float64).reshape(3, 4)
    transposed = torch.arange(6.0).reshape(2, 3).t()
    needs_grad = torch.ones(2, requires_grad=True) * 2

    path = save_tensors({"a": array, "t": transposed, "g": needs_grad}, tmp_path / "x.safetensors")
    loaded = load_tensors(path)

    torch.testing.assert_close(loaded["a"], torch.from_numpy(array))
    torch.testing.assert_close(loaded["t"], transposed)
    assert not loaded["g"].requires_grad


def test_fsspec_memory_url(memory_dir: str) -> None:
    trained = _mlp()
    path = f"{memory_dir}/run/model.safetensors"

    save_module(trained, path, metadata={"epoch": "3"})
    save_module(trained, path, metadata={"epoch": "4"})  # replaces the previous object
    restored = load_module(_mlp(), path)

    _assert_same_state(trained, restored)
    assert load_metadata(path) == {"epoch": "4"}
    fs = fsspec.filesystem("memory")
    assert [Path(p).name for p in fs.ls(f"{memory_dir}/run", detail=False)] == ["model.safetensors"]


def test_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_tensors({"w": torch.ones(4)}, path, metadata={"step": "1"})
    before = path.read_bytes()
    unserializable = torch.zeros(4).to_sparse()

    with pytest.raises(InvalidInput) as info:
        save_tensors({"w": torch.zeros(4), "sparse": unserializable}, path)

    assert "tensors['sparse']" in str(info.value)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_failure_after_the_temporary_is_written_removes_it(tmp_path: Path) -> None:
    # The target is a directory, so the final rename fails after the temporary file is complete.
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("old")

    with pytest.raises(OSError):
        save_tensors({"w": torch.ones(4)}, target)

    assert sorted(os.listdir(tmp_path)) == ["taken"]
    assert (target / "keep.txt").read_text() == "old"


def test_failed_write_to_a_url_keeps_the_previous_object(memory_dir: str) -> None:
    path = f"{memory_dir}/model.safetensors"
    save_tensors({"w": torch.ones(2)}, path)

    with pytest.raises(InvalidInput):
        save_tensors({"w": torch.empty(2, device="meta")}, path)

    torch.testing.assert_close(load_tensors(path)["w"], torch.ones(2))
    fs = fsspec.filesystem("memory")
    assert [Path(p).name for p in fs.ls(memory_dir, detail=False)] == ["model.safetensors"]


def test_parameters_that_view_one_flat_buffer_save_and_load(tmp_path: Path) -> None:
    module = _mlp()
    n_params = sum(p.numel() for p in module.parameters())
    flat = torch.randn(n_params)
    torch.nn.utils.vector_to_parameters(flat, module.parameters())
    first = next(module.parameters())
    assert first.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    path = tmp_path / "flat.safetensors"

    save_module(module, path)
    restored = load_module(_mlp(), path)

    _assert_same_state(module, restored)
    # Each view is stored once, not with the whole buffer behind it.
    assert path.stat().st_size < 2 * flat.numel() * flat.element_size()


def test_tied_weights_save_and_load_strictly(tmp_path: Path) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    module[1].weight = module[0].weight

    save_module(module, tmp_path / "tied.safetensors")
    restored = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    load_module(restored, tmp_path / "tied.safetensors")

    _assert_same_state(module, restored)


def test_load_module_is_strict(tmp_path: Path) -> None:
    path = save_module(torch.nn.Linear(4, 2), tmp_path / "linear.safetensors")

    with pytest.raises(RuntimeError, match="Missing key"):
        load_module(torch.nn.Sequential(torch.nn.Linear(4, 2)), path)


def test_every_invalid_entry_is_reported_at_once(tmp_path: Path) -> None:
    bad = {
        "text": "not a tensor",
        "objects": np.array([object()], dtype=object),
        "ok": torch.ones(1),
    }

    with pytest.raises(InvalidInput) as info:
        save_tensors(bad, tmp_path / "bad.safetensors", metadata={"step": 3})  # type: ignore[dict-item]

    problems = info.value.problems
    assert len(problems) == 3
    assert problems[0].startswith("tensors['text'] is a str")
    assert problems[1].startswith("tensors['objects'] is a numpy array of dtype object")
    assert problems[2].startswith("metadata['step'] = 3")
    assert not os.listdir(tmp_path)


def test_load_metadata_of_a_file_that_is_not_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello, not a checkpoint")

    with pytest.raises(InvalidInput, match="is not a safetensors file"):
        load_metadata(path)
