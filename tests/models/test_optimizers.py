"""The built-in shard optimizers are torch's own classes, built so that they never import
``torch._dynamo`` (``models._torch.without_dynamo``): the same arithmetic, state and names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from dask_train.policy._settings import OptimizerSettings

SRC = Path(__file__).resolve().parents[2] / "src"
_NO_DYNAMO = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from dask_train.engines.holders.optim import FlatOptimizer
    from dask_train.models import OPTIMIZERS
    from dask_train.policy._settings import OptimizerSettings
    for name in sorted(OPTIMIZERS):
        f = FlatOptimizer(np.zeros(8, dtype=np.float32), OptimizerSettings(name, 0.01, {}))
        f.grad.fill_(1.0)
        f.step(1)
        f.optimizer.load_state_dict(f.optimizer.state_dict())
        f.optimizer.zero_grad()
    print(json.dumps("torch._dynamo" in sys.modules))
    """
)


def test_built_in_optimizers_never_import_dynamo() -> None:
    """Building, stepping and (re)loading every built-in shard optimizer leaves torch._dynamo
    unimported: 1.9 s of CPU saved in each server and sync rank at start-up."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", _NO_DYNAMO], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False, (
        f"torch {torch.__version__}: the torch._disable_dynamo / _use_grad_for_differentiable "
        "wrappers changed shape (their functools.wraps chain); update "
        "dask_train.models._torch.without_dynamo: there is no public API to build and step an "
        "optimizer outside torch.compile without importing torch._dynamo.")


@pytest.mark.parametrize(("name", "options"), [
    ("adam", {}), ("adam", {"amsgrad": True, "weight_decay": 0.01}), ("adamw", {}),
    ("sgd", {"momentum": 0.9, "nesterov": True}), ("sgd", {"momentum": 0.9, "foreach": True}),
    ("rmsprop", {"momentum": 0.5, "centered": True}), ("adagrad", {"lr_decay": 0.01}),
    ("sgd", {"weight_decay": 0.1, "maximize": True}),
])
def test_a_light_optimizer_steps_exactly_as_torch_does(name: str, options: dict[str, Any]) -> None:
    """The subclass of runtime._compat.without_dynamo: the same name, state and values as the
    torch class, step after step, and its state loads into the torch class."""
    from dask_train.models import OPTIMIZERS
    from dask_train.models._torch import without_dynamo

    cls = OPTIMIZERS[name]
    light_cls = without_dynamo(cls)
    assert light_cls.__name__ == cls.__name__ and issubclass(light_cls, cls)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(50, generator=gen)
    a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    light, ref = light_cls([a], lr=0.01, **options), cls([b], lr=0.01, **options)
    for _ in range(5):
        g = torch.randn(50, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        light.step()
        ref.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)
    again = cls([torch.nn.Parameter(a.detach().clone())], lr=0.01, **options)
    again.load_state_dict(light.state_dict())
    state = again.state_dict()["state"]
    assert state.keys() == ref.state_dict()["state"].keys()
    for key, value in ref.state_dict()["state"].get(0, {}).items():
        torch.testing.assert_close(state[0][key], value, rtol=0, atol=0)


@pytest.mark.parametrize(("name", "options"), [
    ("adam", {}), ("adamw", {}), ("adam", {"amsgrad": True, "weight_decay": 0.01}),
    ("adamw", {"maximize": True, "betas": (0.8, 0.99), "eps": 1e-6}),
])
def test_the_fused_adam_fast_path_steps_bitwise_as_torch_fused(
        name: str, options: dict[str, Any]) -> None:
    """The engines' fused Adam and AdamW over one tensor call torch's kernel directly after the
    first step (``models._torch._fused_adam_step``): the same parameters and state, bit for bit,
    as torch's own ``fused=True`` step, also after a learning rate change between steps."""
    from dask_train.models import OPTIMIZERS
    from dask_train.models._torch import _fused_adam_step, build_optimizer

    gen = torch.Generator().manual_seed(0)
    start = torch.randn(7510, generator=gen)
    a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ours = build_optimizer(OptimizerSettings(name, 0.01, options), [a])
    ref = OPTIMIZERS[name]([b], lr=0.01, fused=True, **options)
    assert ours.param_groups[0]["fused"], "the engines' Adam should be the fused one on a CPU"
    for i in range(30):
        g = torch.randn(7510, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        if i == 10:
            for opt in (ours, ref):
                opt.param_groups[0]["lr"] = 0.003
        ours.step()
        ref.step()
    assert torch.equal(a.detach(), b.detach())
    for key, value in ref.state[b].items():
        assert torch.equal(ours.state[a][key], value), key
    # It is the fast path that stepped: with the state in place it takes the step itself.
    assert _fused_adam_step(ours) is True


def test_the_fused_adam_fast_path_leaves_other_cases_to_torch() -> None:
    """No state yet, several tensors or a closure: torch's own step runs."""
    from dask_train.models._torch import _fused_adam_step, build_optimizer

    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    opt = build_optimizer(OptimizerSettings("adam", 0.1, {}), [p])
    assert _fused_adam_step(opt) is False  # the first step creates the state
    two = build_optimizer(OptimizerSettings("adam", 0.1, {}),
                          [p, torch.nn.Parameter(torch.zeros(2))])
    assert _fused_adam_step(two) is False
    opt.step()
    assert opt.step(lambda: torch.tensor(1.0)) is not None  # a closure's loss comes back
