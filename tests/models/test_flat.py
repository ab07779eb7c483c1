"""Flat parameter views and balanced shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dask_train.models import FlatModel, build_optimizer, evaluate, flatten_parameters, split_shards
from dask_train.policy._settings import OptimizerSettings


@pytest.mark.parametrize("n,k", [(10, 3), (7510, 2), (5, 5), (3, 8), (1_000_003, 4)])
def test_split_shards_covers_the_vector_balanced(n: int, k: int) -> None:
    shards = split_shards(n, k)
    assert shards[0].start == 0 and shards[-1].stop == n
    assert all(a.stop == b.start for a, b in zip(shards, shards[1:]))
    sizes = [s.size for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert len(shards) == min(k, n)


def test_flat_model_views_change_the_module() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    reference = flatten_parameters(net).clone()
    fm = FlatModel(net)
    assert torch.equal(fm.flat, reference)
    fm.set_flat(np.zeros(fm.n_params, dtype=np.float32))
    assert all(float(p.detach().abs().sum()) == 0.0 for p in net.parameters())


def test_flat_gradient_equals_autograd() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    copy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    copy.load_state_dict(net.state_dict())
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    fm = FlatModel(net)
    out = torch.empty(fm.n_params)
    loss = fm.gradient(x, y, torch.nn.functional.cross_entropy, out=out)
    ref_loss = torch.nn.functional.cross_entropy(copy(x), y)
    ref_loss.backward()
    expected = torch.cat([p.grad.reshape(-1) for p in copy.parameters()])
    assert loss == pytest.approx(float(ref_loss.detach()))
    assert torch.allclose(out, expected)


def test_evaluate_reports_accuracy_and_loss() -> None:
    net = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.eye(2))
    x = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]], dtype=np.float32)
    y = np.array([0, 1, 1])
    scores = evaluate(net, x, y, loss="cross_entropy", batch_size=2)
    assert scores["accuracy"] == pytest.approx(2 / 3)
    with torch.no_grad():
        expected = float(torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y)))
    assert scores["loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_optimizers_with_a_fused_kernel_use_it_and_match_the_default(name: str) -> None:
    options = {"momentum": 0.9} if name == "sgd" else {}
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 50)) for _ in range(2)]
    fused = build_optimizer(OptimizerSettings(name, 0.01, options), [params[0]])
    plain = build_optimizer(OptimizerSettings(name, 0.01, {**options, "foreach": False}), [params[1]])
    assert fused.defaults["fused"] is True
    assert not plain.defaults.get("fused")  # an implementation chosen in the options is kept
    for step in range(5):
        for p in params:
            p.grad = torch.cos(p.detach() * (step + 1))
        fused.step()
        plain.step()
    torch.testing.assert_close(params[0], params[1], rtol=1e-5, atol=1e-6)
