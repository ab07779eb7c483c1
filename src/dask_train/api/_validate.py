"""Checks run in the client before anything is submitted; each returns every problem it finds."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dask_train.api._model import travel_problems
from dask_train.api._probe import check_module_output, probe_module
from dask_train.api._settings import Settings, job_metrics
from dask_train.data._blocks import is_dask_array
from dask_train.data._inputs import label
from dask_train.models._array import ArrayModel
from dask_train.models._frameworks import is_keras_model, keras_sparse_labels
from dask_train.models._torch import is_classification, loss_name, primary_output, takes_weights


def check_sample_weight(weights: Any, X: Any, module: Any, loss: Any) -> list[str]:
    """Problems with ``fit(sample_weight=)``: one non-negative number per row, and a loss that
    can weigh samples."""
    if weights is None:
        return []
    if isinstance(module, ArrayModel):
        return ["sample_weight= is not available for a dt.ArrayModel: weigh the rows inside "
                "its loss_grad function instead."]
    if not is_dask_array(weights) or not np.issubdtype(weights.dtype, np.number):
        return [f"sample_weight of type {type(weights).__name__} is invalid: pass one number per "
                "row of X (a numpy or dask array)."]
    problems = []
    if weights.ndim != 1 or weights.shape[0] != X.shape[0]:
        problems.append(f"sample_weight has shape {weights.shape} but X has {X.shape[0]} rows: "
                        "pass one weight per row of X (a 1-D array).")
    if not takes_weights(loss) and not is_keras_model(module):  # Keras losses are per sample
        problems.append(f"loss={loss_name(loss)} cannot weigh samples: use a loss name, a torch "
                        "loss module (it has a reduction), or a function "
                        "fn(output, target, weight) -> scalar.")
    return problems


def check_array_model(model: ArrayModel, settings: Settings, X: Any, y: Any, *,
                      resume: bool) -> list[str]:
    """Problems with training an ArrayModel under these settings, found before any task runs."""
    problems = model.problems()
    if settings.strategy not in ("sync", "auto"):  # "auto" is sync: the only numpy engine
        problems.append(
            f"strategy={settings.strategy!r} cannot train a dt.ArrayModel: use strategy='sync' "
            "(its gradients are averaged by a Dask tree reduction; async-ps trains torch modules)."
        )
    if not problems and getattr(X, "ndim", 0) == 2:
        problems += model.check_on(int(X.shape[1]), y.dtype)
    return problems


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


def check_stop_metrics(stop: Any, metrics: list[str]) -> list[str]:
    """Stop conditions watching a metric the job never produces would never fire: refuse them."""
    return [
        f"stop={cond!r} watches {cond.metric!r}, which this job's scores do not hold: they hold "
        f"{metrics}; use one of those (a typo?)."
        for cond in stop if isinstance(getattr(cond, "metric", None), str)
        and cond.metric not in metrics
    ]


def check_labels(low: int, high: int, module_output: int, loss: Any) -> list[str]:
    """Problems with the label range for classification losses."""
    if not is_classification(loss) and not keras_sparse_labels(loss):
        return []
    if low < 0 or high >= module_output:
        return [
            f"y has labels from {low} to {high} but the module outputs {module_output} classes: "
            f"labels must lie in [0, {module_output - 1}]; enlarge the output layer or re-encode y."
        ]
    return []


def check_label_range(module: Any, loss: Any, X: Any, label_range: tuple[Any, Any]) -> list[str]:
    """Problems with the labels' range ``(low, high)`` against the classes ``module`` outputs
    for rows shaped like ``X``'s."""
    out = primary_output(probe_module(module, tuple(X.shape[1:]), X.dtype))
    low, high = label_range
    return check_labels(int(low), int(high), int(out.shape[1]), loss)


def check_fit(s: Settings, X: Any, y: Any, validation: Any, *, resume: bool, sample_weight: Any,
              typed: Callable[[], Any], factory: Any = None) -> list[str]:
    """Every problem with one ``fit`` of these settings on this data, found before any work.

    ``typed()`` is ``X`` in the dtype the model will see; ``factory`` the function that built
    ``s.module``, if one did.
    """
    problems = s.problems()
    m = s.model
    if resume and s.recovery.checkpoint is None:
        problems.append(
            "resume=True needs checkpoints to resume from: pass "
            "checkpoint=dt.CheckpointConfig(path) (or a directory) to the Trainer."
        )
    problems += check_data(X, y)
    problems += check_sample_weight(sample_weight, X, m.module, m.loss)
    problems += check_validation(validation, X, y)
    needs_scores = [c for c in s.stop if hasattr(c, "metric")]
    if needs_scores and validation is None:
        problems.append(
            f"stop={needs_scores!r} needs scores: pass validation=(X_val, y_val) to fit."
        )
    elif needs_scores and s.scoring.scorer == 0:
        problems.append(
            f"stop={needs_scores!r} needs scores but scorer=0: use scorer=1."
        )
    if not problems:
        problems += travel_problems(m.module, factory)
    if not problems and (isinstance(m.module, torch.nn.Module) or is_keras_model(m.module)):
        problems += check_module_output(m.module, typed(), y, m.loss, m.metrics)
    if not problems:
        problems += check_stop_metrics(s.stop, job_metrics(m.module, m.loss, m.metrics))
    if isinstance(m.module, ArrayModel):
        problems += check_array_model(m.module, s, X, y, resume=resume)
    return problems
