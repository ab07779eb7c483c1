"""How a model travels to the roles: pickled whole, its parameter layout checked (no cluster)."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from dask_train.api._model import build_from, is_factory, travel_problems
from dask_train.errors import InvalidInput
from dask_train.models._transport import ModulePayload, ParamLayout, travelling, unwrap


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class GrowsOnUnpickle(nn.Module):
    """A module whose copy is not the client's: one parameter more after unpickling."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.extra = nn.Parameter(torch.zeros(3))


def weight_normed() -> nn.Module:
    return nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(8, 16)), nn.ReLU(),
                         nn.Linear(16, 2))


def test_a_tie_and_an_lstm_survive_the_trip() -> None:
    net = Tied()
    payload = pickle.loads(pickle.dumps(ModulePayload.of(net)))
    copy = payload.module()
    assert copy.a.weight is copy.b.weight  # one tensor, as on the client
    assert payload.layout.shared == [["a.weight", "b.weight"]]
    assert payload.layout.n_params == sum(p.numel() for p in net.parameters()) == 8 * 8 + 8 + 8
    lstm = nn.LSTM(8, 12, batch_first=True)
    back = pickle.loads(pickle.dumps(travelling(lstm))).module()
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(back(x)[0], lstm(x)[0])
    assert unwrap(lstm) is lstm  # anything else passes as it is


def test_a_module_that_changes_on_the_way_is_refused_by_name() -> None:
    payload = pickle.loads(pickle.dumps(ModulePayload.of(GrowsOnUnpickle())))
    with pytest.raises(ValueError, match="module=GrowsOnUnpickle arrived on this worker with "
                                         "another parameter layout than the client's: 2 parameter "
                                         "tensors on the client, 3 here"):
        payload.module()
    [problem] = travel_problems(GrowsOnUnpickle())
    assert problem.startswith("module=GrowsOnUnpickle arrived")


def test_a_parametrized_module_needs_a_factory_and_says_so() -> None:
    [problem] = travel_problems(weight_normed())
    assert problem.startswith("module=Sequential cannot be pickled")
    assert "dt.Trainer(make_net, ...)" in problem
    # A factory travels with the client's initial values.
    assert is_factory(weight_normed) and not is_factory(weight_normed())
    net = build_from(weight_normed, seed=3)
    assert travel_problems(net, weight_normed) == []
    copy = pickle.loads(pickle.dumps(ModulePayload.of(net, weight_normed))).module()
    for (name, a), (_, b) in zip(net.state_dict().items(), copy.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


def test_a_factory_is_seeded_for_itself_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = build_from(weight_normed, seed=5), build_from(weight_normed, seed=5)
    torch.testing.assert_close(a[2].weight, b[2].weight)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's stream is untouched
    with pytest.raises(InvalidInput, match="module=<lambda> returned int"):
        build_from(lambda: 3, seed=0)


def test_the_layout_names_frozen_parameters_out() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    net[0].requires_grad_(False)
    layout = ParamLayout.of(net)
    assert layout.names == ["1.weight", "1.bias"] and layout.n_params == 10
