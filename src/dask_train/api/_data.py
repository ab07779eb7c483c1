"""The data a fit is given, made ready: validation sets in memory or spread over the cluster."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from distributed import Client

from dask_train.data._blocks import SpreadValidation, as_dask_array, persist_pairs


def _is_dask(part: Any) -> bool:
    return hasattr(part, "dask") and hasattr(part, "compute")


def materialize(validation: Any, dtype: Any = np.float32, *, keep_dask: bool = False) -> Any:
    """Validation data as numpy, or (``keep_dask``) dask arrays left on the cluster.

    Floating inputs take ``dtype`` (the model's parameters'); integer inputs (token ids) are
    kept as they are. Anything that is not a pair is returned unchanged for the checks to name.
    """
    if validation is None or not isinstance(validation, (tuple, list)) or len(validation) != 2:
        return validation
    if keep_dask and any(_is_dask(part) or isinstance(part, Mapping) and
                         any(_is_dask(v) for v in part.values()) for part in validation):
        xv, yv = (as_dask_array(part) for part in validation)
        if xv.dtype != dtype and xv.dtype.kind == "f":
            xv = xv.astype(dtype)
        return xv, yv
    out = []
    for part in validation:
        if isinstance(part, Mapping):  # several inputs: one array of records, as X
            part = as_dask_array(part)
        compute = getattr(part, "compute", None)
        part = compute() if callable(compute) else part
        out.append(np.ascontiguousarray(np.asarray(part)))
    x_np, y_np = out
    if x_np.dtype != dtype and x_np.dtype.kind == "f":  # integer inputs (token ids) are kept
        x_np = x_np.astype(dtype)
    return x_np, y_np


def spread_validation(client: Client, validation: Any) -> SpreadValidation | None:
    """Persist a dask validation pair as co-located blocks spread over the workers; None for a
    validation set in memory (or none)."""
    if validation is None or not any(_is_dask(part) for part in validation):
        return None
    xv, yv = validation
    futures = client.sync(persist_pairs, client, xv, yv)
    return SpreadValidation(futures, int(xv.shape[0]))
