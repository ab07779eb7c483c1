"""Checks run in the client before anything is submitted; each returns every problem it finds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dask_train.api._model import travel_problems
from dask_train.api._probe import check_module_output, probe_module
from dask_train.api._settings import Settings, job_metrics
from dask_train.data._blocks import is_dask_array
from dask_train.data._checks import check_data, check_validation
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
