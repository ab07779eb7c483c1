"""A fit's validation data, made ready: in memory, or spread over the cluster where its blocks
are scored (the training data is :class:`~dask_train.data._training.TrainingData`)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from distributed import Client

from dask_train.data._blocks import (
    SpreadValidation,
    as_dask_array,
    persist_pairs,
)
from dask_train.data._inputs import cast_floats, is_lazy, to_numpy, writable

logger = logging.getLogger(__name__)


def materialize(validation: Any, dtype: Any = np.float32, *, keep_dask: bool = False) -> Any:
    """Validation data as numpy, or (``keep_dask``) dask arrays left on the cluster.

    Several inputs or targets (a dict or tuple of arrays) become one array of records, as ``X``
    and ``y`` do. Floating inputs take ``dtype`` (the model's parameters'); integer inputs
    (token ids) are kept as they are. Anything that is not a pair is returned unchanged for the
    checks to name.
    """
    if validation is None or not isinstance(validation, (tuple, list)) or len(validation) != 2:
        return validation
    from dask_train.data._xarray import from_xarray

    # Rows along the sample dimension, variables as features, as the training data's.
    validation = from_xarray(*validation, name="validation's X")
    names = ("X_val", "y_val")
    if keep_dask and any(is_lazy(part) for part in validation):
        xv, yv = (as_dask_array(part, name=n) for part, n in zip(validation, names))
        return cast_floats(xv, dtype), yv
    x_np, y_np = (writable(to_numpy(part, name=n))
                  for part, n in zip(validation, names))
    return cast_floats(x_np, dtype), y_np


def spread_validation(client: Client, validation: Any) -> SpreadValidation | None:
    """Persist a dask validation pair as co-located blocks spread over the workers; None for a
    validation set in memory (or none)."""
    if validation is None or not any(is_lazy(part) for part in validation):
        return None
    xv, yv = validation
    futures = client.sync(persist_pairs, client, xv, yv)
    return SpreadValidation(futures, int(xv.shape[0]))
