"""Read-only data (pandas 3's columns, a read-only memory map) becomes writable once, where it
enters: the held-out set a fit materializes and each training block, so that no batch's tensor
shares memory torch cannot protect (its "The given NumPy array is not writable" warning), and
writable data is not copied at all."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import torch

from dask_train.api._data import materialize
from dask_train.data._blocks import as_pair
from dask_train.models._torch import model_inputs


def _frame() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame({"city": rng.integers(0, 10, 50), "a": rng.random(50, dtype=np.float32),
                         "label": rng.integers(0, 2, 50)})


def test_pandas_validation_is_writable_and_its_batches_make_tensors_quietly() -> None:
    df = _frame()
    yv = df["label"].to_numpy()
    assert not yv.flags.writeable  # pandas 3 hands out read-only views: the case at hand
    xv, y_np = materialize(({"city": df["city"].to_numpy(), "a": df[["a"]].to_numpy()}, yv))
    assert xv.flags.writeable and y_np.flags.writeable
    np.testing.assert_array_equal(y_np, yv)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's UserWarning would raise here
        batch = model_inputs(y_np[:16])
        inputs = model_inputs(xv[:16])
    assert isinstance(batch, torch.Tensor) and sorted(inputs) == ["a", "city"]


def test_a_read_only_block_is_copied_once_and_a_writable_one_not_at_all() -> None:
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.arange(6)
    x_out, y_out = as_pair(x, y)
    assert x_out is x and y_out is y  # writable and contiguous already: no copy
    x.flags.writeable = y.flags.writeable = False
    x_out, y_out = as_pair(x, y)
    assert x_out is not x and x_out.flags.writeable and y_out.flags.writeable
    np.testing.assert_array_equal(x_out, x)
    x_cast, _ = as_pair(x, y, np.float64)  # a cast is the one copy already
    assert x_cast.dtype == np.float64 and x_cast.flags.writeable
