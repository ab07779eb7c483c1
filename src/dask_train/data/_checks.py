"""Checks of the training data's types, shapes, chunks and dtypes, and of ``validation=``, made
before anything is submitted, by ``Trainer.fit`` and ``dt.run`` alike. Free of any framework:
``dt.run`` checks its data in a client that never imports torch. In the data layer, beside the
conversions whose results it checks (``is_dask_array``, ``label``), so that the checks no longer
go from ``api`` to ``data`` and back.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dask_train.data._blocks import is_dask_array
from dask_train.data._inputs import label


def check_data(X: Any, y: Any, *, name_x: str = "X", name_y: str = "y") -> list[str]:
    """Problems with the training arrays' types, shapes, chunks and dtypes (nothing computed)."""
    problems: list[str] = []
    for name, arr in ((name_x, X), (name_y, y)):
        if not is_dask_array(arr):
            problems.append(f"{name} of type {type(arr).__name__} is invalid: pass a dask array.")
            continue
        if arr.dtype.names is not None:  # several inputs: each field must be numeric
            bad = [n for n in arr.dtype.names if not np.issubdtype(arr.dtype[n].base, np.number)]
            if bad:
                problems.append(f"{label(bad[0], name)} has dtype {arr.dtype[bad[0]].base}, "
                                "which is not numeric: convert it, or encode categories as "
                                "numbers.")
        elif not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
            problems.append(
                f"{name} has dtype {arr.dtype}, which is not numeric: convert it, e.g. "
                f"{name}.astype('float32'), or encode categories as numbers first."
            )
        if any(math.isnan(c) for c in arr.chunks[0]):
            problems.append(
                f"{name} has unknown chunk sizes: call {name}.compute_chunk_sizes() first, or build "
                "it from a dask DataFrame with to_dask_array(lengths=True)."
            )
    if problems:
        return problems
    if X.ndim < 2 and X.dtype.names is None:
        problems.append(f"X has shape {X.shape}: use a 2-D array (samples, features) or more dims.")
    if y.ndim not in (1, 2):
        problems.append(f"y has shape {y.shape}: use a 1-D array of labels or 2-D targets.")
    if X.shape[0] != y.shape[0]:
        problems.append(
            f"X has {X.shape[0]} rows but y has {y.shape[0]}: pass one label per row of X."
        )
    if X.shape[0] == 0:
        problems.append("X has 0 rows: pass at least one training sample.")
    return problems


def _inputs_text(a: Any, name: str) -> str:
    """What ``a`` holds per row, for messages: each input's shape, or the one sample shape."""
    dtype = getattr(a, "dtype", None)
    if dtype is None or dtype.names is None:
        return f"one array with rows shaped {tuple(np.shape(a)[1:])}"
    return ", ".join(f"{label(n, name)} {tuple(dtype[n].shape)}" for n in dtype.names)


def _same_inputs(part: Any, full: Any, name: str) -> list[str]:
    """Validation data must hold the inputs (or targets) the training data holds."""
    if not is_dask_array(full) or full.dtype.names is None and not _is_records(part):
        return []
    have, want = _inputs_text(part, f"{name}_val"), _inputs_text(full, f"{name}_val")
    if have == want:
        return []
    return [f"validation {name}_val holds {have} but {name} holds {want.replace(name + '_val', name)}"
            f": give {name}_val the same inputs (the same keys, or tuple items in the same "
            "order) with the same shapes per row."]


def _is_records(a: Any) -> bool:
    return getattr(getattr(a, "dtype", None), "names", None) is not None


def check_validation(validation: Any, X: Any, y: Any = None) -> list[str]:
    """Problems with ``validation=(X_val, y_val)`` (as arrays: several inputs or targets are
    records, see :func:`dask_train.api._data.materialize`)."""
    if validation is None:
        return []
    if not isinstance(validation, (tuple, list)) or len(validation) != 2:
        return ["validation is invalid: pass a pair (X_val, y_val) of arrays, or None."]
    xv, yv = validation
    problems = []
    if len(xv) != len(yv):
        problems.append(
            f"validation has {len(xv)} rows in X_val but {len(yv)} in y_val: pass one label per row."
        )
    if len(xv) == 0:
        problems.append("validation is empty: pass at least one validation sample.")
    if is_dask_array(X) and X.dtype.names is None and not _is_records(xv) and \
            np.shape(xv)[1:] != X.shape[1:]:
        problems.append(
            f"validation X_val has sample shape {np.shape(xv)[1:]} but X has {X.shape[1:]}: "
            "use the same features."
        )
    return problems + _same_inputs(xv, X, "X") + _same_inputs(yv, y, "y")
