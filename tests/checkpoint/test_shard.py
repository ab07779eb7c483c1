"""A shard's parameters and optimizer state round-trip exactly through safetensors, never a pickle."""

from __future__ import annotations

import json
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from dask_train.checkpoint import ShardState, load_metadata, load_shard, restore_optimizer, save_shard
from dask_train.errors import InvalidInput
from dask_train.models import OPTIMIZERS, build_optimizer
from dask_train.policy._settings import OptimizerSettings

CASES: list[tuple[str, dict[str, Any]]] = [
    ("sgd", {}),
    ("sgd", {"momentum": 0.9}),
    ("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    ("adam", {}),
    ("adam", {"amsgrad": True}),
    ("adamw", {"weight_decay": 0.1}),
    ("rmsprop", {}),
    ("rmsprop", {"momentum": 0.5, "centered": True}),
    ("adagrad", {"lr_decay": 0.01}),
]
SIZE = 37


def _step(param: torch.nn.Parameter, optimizer: torch.optim.Optimizer, grad: torch.Tensor) -> None:
    param.grad = grad.clone()
    optimizer.step()


def _grads(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SIZE, generator=gen) for _ in range(n)]


@pytest.fixture
def memory_dir() -> Iterator[str]:
    fs = fsspec.filesystem("memory")
    folder = f"/dask-train-shard-{uuid.uuid4().hex}"
    yield f"memory://{folder}"
    if fs.exists(folder):
        fs.rm(folder, recursive=True)


def test_every_optimizer_is_covered() -> None:
    assert {name for name, _ in CASES} == set(OPTIMIZERS)


@pytest.mark.parametrize(("name", "options"), CASES, ids=[f"{n}-{sorted(o)}" for n, o in CASES])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_resumed_optimizer_continues_identically(
    name: str, options: dict[str, Any], where: str, tmp_path: Path, memory_dir: str
) -> None:
    param = torch.nn.Parameter(torch.randn(SIZE))
    optimizer = build_optimizer(OptimizerSettings(name, 0.05, options), [param])
    for grad in _grads(3, seed=1):
        _step(param, optimizer, grad)
    base = str(tmp_path) if where == "local" else memory_dir
    path = save_shard(f"{base}/shard-0.safetensors", param=param, optimizer=optimizer,
                      metadata={"shard": "0", "step": "3"})

    state = load_shard(path)
    assert state.optimizer_name == type(optimizer).__name__
    assert state.metadata == {"shard": "0", "step": "3"}
    assert torch.equal(state.param, param.detach())
    restored_param = torch.nn.Parameter(state.param.clone())
    restored = build_optimizer(OptimizerSettings(name, 0.05, options), [restored_param])
    restore_optimizer(restored, state)

    for grad in _grads(5, seed=2):
        _step(param, optimizer, grad)
        _step(restored_param, restored, grad)
    assert torch.equal(param.detach(), restored_param.detach())
    original_state, restored_state = optimizer.state[param], restored.state[restored_param]
    assert original_state.keys() == restored_state.keys()
    for key, value in original_state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, restored_state[key]), key
        else:
            assert value == restored_state[key], key


def test_tensor_and_scalar_state_layout(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.Adam([param], lr=0.1)
    _step(param, optimizer, torch.ones(4))
    # A non-tensor scalar in the state, as some optimizers keep (and custom ones may).
    optimizer.state[param]["count"] = 7
    optimizer.state[param]["best"] = None
    path = save_shard(tmp_path / "s.safetensors", param=param, optimizer=optimizer)

    metadata = load_metadata(path)
    assert metadata["optimizer"] == "Adam"
    assert json.loads(metadata["optim_scalars"]) == {"count": 7, "best": None}
    state = load_shard(path)
    assert set(state.optimizer_state) == {"exp_avg", "exp_avg_sq", "step", "count", "best"}
    assert state.optimizer_state["count"] == 7 and state.optimizer_state["best"] is None
    assert float(state.optimizer_state["step"]) == 1.0
    assert state.metadata == {}


def test_hyper_parameters_come_from_the_new_optimizer(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.Adam([param], lr=0.1)
    _step(param, optimizer, torch.ones(4))
    state = load_shard(save_shard(tmp_path / "s.safetensors", param=param, optimizer=optimizer))
    new_param = torch.nn.Parameter(state.param.clone())
    new = torch.optim.Adam([new_param], lr=0.001, betas=(0.8, 0.9))
    restore_optimizer(new, state)
    assert new.param_groups[0]["lr"] == 0.001 and new.param_groups[0]["betas"] == (0.8, 0.9)
    assert float(new.state[new_param]["step"]) == 1.0


def test_restoring_twice_shares_no_buffer(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    _step(param, optimizer, torch.ones(4))
    state = load_shard(save_shard(tmp_path / "s.safetensors", param=param, optimizer=optimizer))
    copies = []
    for _ in range(2):
        p = torch.nn.Parameter(state.param.clone())
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        restore_optimizer(opt, state)
        copies.append((p, opt))
    _step(*copies[0], torch.ones(4))
    assert not torch.equal(copies[0][1].state[copies[0][0]]["momentum_buffer"],
                           copies[1][1].state[copies[1][0]]["momentum_buffer"])


def test_state_before_any_step_round_trips(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    state = load_shard(save_shard(tmp_path / "s.safetensors", param=param, optimizer=optimizer))
    assert state.optimizer_state == {} and state.optimizer_name == "SGD"
    fresh_param = torch.nn.Parameter(state.param.clone())
    fresh = torch.optim.SGD([fresh_param], lr=0.1)
    restore_optimizer(fresh, state)
    assert len(fresh.state) == 0


def test_restore_refuses_another_optimizer_or_size(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.Adam([param], lr=0.1)
    _step(param, optimizer, torch.ones(4))
    state = load_shard(save_shard(tmp_path / "s.safetensors", param=param, optimizer=optimizer))
    other = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(InvalidInput, match="holds Adam optimizer state but the optimizer is SGD"):
        restore_optimizer(torch.optim.SGD([other], lr=0.1), state)
    bigger = torch.nn.Parameter(torch.zeros(5))
    with pytest.raises(InvalidInput, match="has 4 parameters but the optimizer's has 5"):
        restore_optimizer(torch.optim.Adam([bigger], lr=0.1), state)
    wrong = ShardState(torch.zeros(4), {"exp_avg": torch.zeros(3)}, "Adam")
    with pytest.raises(InvalidInput, match="'exp_avg' has 3 values"):
        restore_optimizer(torch.optim.Adam([other], lr=0.1), wrong)


def test_save_refuses_bad_input(tmp_path: Path) -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(InvalidInput, match="holds 2 parameters"):
        save_shard(tmp_path / "s.safetensors", param=a, optimizer=torch.optim.SGD([a, b], lr=0.1))
    optimizer = torch.optim.SGD([a], lr=0.1)
    with pytest.raises(InvalidInput, match="reserved"):
        save_shard(tmp_path / "s.safetensors", param=a, optimizer=optimizer, metadata={"optimizer": "x"})
    optimizer.state[a]["odd"] = [1, 2]
    with pytest.raises(InvalidInput, match="'odd' is a list"):
        save_shard(tmp_path / "s.safetensors", param=a, optimizer=optimizer)
    assert not (tmp_path / "s.safetensors").exists()


class _Trap:
    """Unpickling this runs code: it records that it happened."""

    ran: list[str] = []

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_Trap.ran.append, ("unpickled",))


def test_loading_never_unpickles(tmp_path: Path) -> None:
    pickled = tmp_path / "pickled.safetensors"
    pickled.write_bytes(pickle.dumps({"param": _Trap()}))
    torch_file = tmp_path / "torch.safetensors"
    torch.save({"param": torch.zeros(2), "trap": _Trap()}, torch_file)
    for path in (pickled, torch_file):
        with pytest.raises(InvalidInput, match="is not a safetensors file"):
            load_shard(path)
    assert _Trap.ran == []


def test_other_safetensors_and_truncated_files_are_refused(tmp_path: Path) -> None:
    from dask_train.checkpoint import save_tensors

    plain = save_tensors({"w": torch.zeros(2)}, tmp_path / "plain.safetensors")
    with pytest.raises(InvalidInput, match="not a checkpoint shard"):
        load_shard(plain)
    param = torch.nn.Parameter(torch.zeros(1000))
    path = save_shard(tmp_path / "s.safetensors", param=param, optimizer=torch.optim.SGD([param], lr=0.1))
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) - 100])
    with pytest.raises(InvalidInput, match="damaged or truncated"):
        load_shard(path)
