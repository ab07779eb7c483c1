"""Lightning's and Hugging Face's report callbacks take their options and their logs the same
way: every wrong option named at once when the callback is made, and from a log the one-number
values only, under names the job's history does not set itself."""

from __future__ import annotations

import math

import pytest
import torch

import dask_train as dt
from dask_train.engines.run.metrics import logged_numbers


@pytest.fixture(params=["lightning", "huggingface"])
def report(request: pytest.FixtureRequest) -> type:
    return getattr(dt, request.param).Report


def test_every_wrong_option_is_named_at_once(report: type) -> None:
    with pytest.raises(dt.InvalidInput) as info:
        report(object(), metrics="loss", reduce="median", checkpoint="yes")
    problems = info.value.problems
    assert len(problems) == 4, problems
    for named in ("ctx=", "metrics='loss'", "reduce='median'", "checkpoint='yes'"):
        assert any(named in p for p in problems), (named, problems)


def test_a_log_gives_its_one_number_values_under_the_jobs_own_names() -> None:
    logged = {"loss": torch.tensor(0.5), "val_acc": 0.75, "lr": 1e-3, "epoch": 2.0, "step": 10,
              "worker": 1, "matrix": torch.ones(2), "note": "text", "flag": True,
              "nan": float("nan")}
    numbers = logged_numbers(logged, None)
    assert set(numbers) == {"loss", "val_acc", "lr", "nan"}
    assert numbers["loss"] == 0.5 and isinstance(numbers["loss"], float)
    assert math.isnan(numbers["nan"])  # the job's on_nan decides about it
    assert logged_numbers(logged, ["val_acc", "epoch"]) == {"val_acc": 0.75}
    assert logged_numbers(None, None) == {}
