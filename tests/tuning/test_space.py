"""Search spaces, gang reservation and pruning steps: pure rules, no cluster."""

from __future__ import annotations

import pytest
import torch

import dask_train as dt
from dask_train.errors import InvalidInput
from dask_train.tuning import Reservations, Space
from dask_train.tuning._trial import progress_step


def test_space_maps_ranges_and_choices_to_optuna_distributions() -> None:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    space = Space.parse({"lr": dt.loguniform(1e-4, 1e-1), "dropout": dt.uniform(0.0, 0.5),
                         "hidden": dt.intuniform(16, 256, log=True), "batch_size": [64, 128],
                         "epochs": 3})
    dists = space.distributions()
    assert dists["lr"] == FloatDistribution(1e-4, 1e-1, log=True)
    assert dists["dropout"] == FloatDistribution(0.0, 0.5)
    assert dists["hidden"] == IntDistribution(16, 256, log=True)
    assert dists["batch_size"] == CategoricalDistribution((64, 128))
    assert "epochs" not in dists and space.fixed == {"epochs": 3}
    assert space.values({"lr": 0.01, "batch_size": 64}) == {"lr": 0.01, "batch_size": 64,
                                                            "epochs": 3}
    assert space.first() == {"lr": 1e-4, "dropout": 0.0, "hidden": 16, "batch_size": 64,
                             "epochs": 3}


def test_choices_optuna_cannot_store_are_sampled_by_position() -> None:
    space = Space.parse({"optimizer": [torch.optim.SGD, "adam"]})
    assert space.distributions()["optimizer"].choices == (0, 1)
    assert space.values({"optimizer": 0}) == {"optimizer": torch.optim.SGD}
    assert space.values({"optimizer": 1}) == {"optimizer": "adam"}


def test_every_bad_range_is_reported_at_once() -> None:
    with pytest.raises(InvalidInput) as info:
        Space.parse({"lr": dt.loguniform(0.0, 1.0), "a": dt.uniform(2.0, 1.0),
                     "n": dt.intuniform(1.5, 4), "empty": []})
    problems = info.value.problems
    assert len(problems) == 4
    assert "log range needs low > 0" in problems[0]
    assert "low < high" in problems[1]
    assert "integer bounds" in problems[2]
    assert "at least one choice" in problems[3]
    with pytest.raises(InvalidInput, match="pass a dict"):
        Space.parse([("lr", 0.1)])


def test_a_gang_is_taken_whole_or_not_at_all() -> None:
    book = Reservations()
    alive = ["a", "b", "c", "d"]
    assert book.take(alive, need=2, trial=0) == ["a", "b"]
    # Three free workers are needed and only two are free: nothing is taken, so no trial can
    # hold half of what it needs while waiting for another's half.
    assert book.take(alive, need=3, trial=1) is None
    assert book.free(alive) == ["c", "d"]
    assert book.take(alive, need=2, trial=2) == ["c", "d"]
    assert book.take(alive, need=1, trial=3) is None
    book.give_back(0)
    assert book.take(alive, need=2, trial=4) == ["a", "b"]  # the same gang again: its data is there


def test_a_dead_worker_is_never_reserved_and_a_used_gang_is_preferred() -> None:
    book = Reservations()
    assert book.take(["a", "b", "c"], need=2, trial=0) == ["a", "b"]
    book.give_back(0)
    # "a" left the cluster: its gang cannot be reused; a new one is formed from live workers.
    assert book.take(["b", "c", "e"], need=2, trial=1) == ["b", "c"]
    book.give_back(1)
    assert book.take(["a", "b", "c", "e"], need=2, trial=2) == ["a", "b"]


def test_pruning_steps_are_thousandths_of_the_planned_training() -> None:
    assert progress_step(0, 4000) == 1
    assert progress_step(400, 4000) == 100
    assert progress_step(4000, 4000) == 1000
    assert progress_step(9000, 4000) == 1000  # a trial longer than planned stays at the last rung
