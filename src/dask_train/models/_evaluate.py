"""Evaluation of a torch module on held-out data: the loss, accuracy and the user's metrics."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dask_train.models._outputs import join, to_host
from dask_train.models._torch import (
    call_module,
    is_classification,
    model_inputs,
    primary_output,
    resolve_loss,
)

#: Built-in metric names: what every torch job's scores can hold without ``metrics=``.
BUILTIN_METRICS = ("loss", "accuracy")


def metric_names(loss: Any, metrics: Mapping[str, Any] | None) -> list[str]:
    """The keys a torch job's score records hold: loss, accuracy for classification, extras."""
    names = ["loss"] + (["accuracy"] if is_classification(loss) else [])
    return names + [n for n in (metrics or {}) if n not in names]


def is_metric_object(metric: Any) -> bool:
    """Whether ``metric`` keeps state over batches (``reset``/``update``/``compute``, as a
    torchmetrics metric) rather than being a function of the whole output."""
    return all(hasattr(metric, a) for a in ("reset", "update", "compute"))


def extra_metrics(metrics: Mapping[str, Any] | None, outputs: list[Any],
                  targets: list[np.ndarray]) -> dict[str, float]:
    """``metrics`` over the whole validation set, from its batches' ``outputs`` (what the model
    returned, on the host: see :func:`~._outputs.to_host`) and ``targets`` (numpy, a record
    array for several targets).

    A function gets the whole output over every row (a tensor, or a dict, tuple or
    ``ModelOutput`` joined batch by batch) and the target (a tensor, or a dict of tensors) and
    picks what it needs. An object with ``reset``/``update``/``compute`` (a torchmetrics metric)
    is fed batch by batch with the predictions (:func:`~._torch.primary_output`) and targets.
    """
    extra = {k: m for k, m in (metrics or {}).items() if not isinstance(m, str)}
    if not extra or not outputs:
        return {}
    out: dict[str, float] = {}
    whole: tuple[Any, Any] | None = None  # joined once, for every function
    for name, metric in extra.items():
        if is_metric_object(metric):
            metric.reset()
            for o, t in zip(outputs, targets):
                metric.update(primary_output(o), model_inputs(np.asarray(t)))
            value = metric.compute()
        else:
            if whole is None:
                whole = (join(outputs, [len(t) for t in targets]),
                         model_inputs(np.concatenate(targets)))
            value = metric(*whole)
        out[name] = float(value)
    return out


def _loss_sum(loss: Any, loss_fn: Any, raw: Any, yb: Any, rows: int) -> float:
    """One batch's loss summed over its rows: exactly for a named loss, else the batch mean
    (of a loss module on the predictions, of a function of yours on the whole output) times
    the rows."""
    if isinstance(loss, str):
        return float(loss_fn(_predictions(raw), yb, reduction="sum"))
    given = _predictions(raw) if isinstance(loss, torch.nn.Module) or \
        isinstance(raw, torch.Tensor) else raw
    return float(loss_fn(given, yb)) * rows


def _predictions(raw: Any) -> torch.Tensor:
    out = primary_output(raw)
    return out.float() if out.is_floating_point() else out


def evaluate(
    module: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    loss: Any,
    batch_size: int = 4096,
    metrics: Mapping[str, Any] | None = None,
    device: Any = None,
) -> dict[str, float]:
    """Mean loss (and accuracy for classification losses) of ``module`` on ``(x, y)``.

    ``loss`` is a name, an ``nn.Module`` or a callable (see :func:`resolve_loss`). A named loss is
    summed exactly (``reduction="sum"``); a module or callable is taken as a batch mean and
    weighted by the batch's rows. ``metrics`` adds named metrics (see ``Trainer(metrics=)`` and
    :func:`extra_metrics`). Batches go to ``device`` (the module's); metrics get the outputs
    back on the host.
    """
    extra = {k: m for k, m in (metrics or {}).items() if not isinstance(m, str)}
    outputs: list[Any] = []
    if isinstance(loss, torch.nn.Module) and device is not None:
        loss = loss.to(device)  # class weights go where the outputs are
    loss_fn = resolve_loss(loss)
    classify = is_classification(loss)
    was_training = module.training
    module.eval()
    total_loss, correct, n = 0.0, 0, len(x)
    try:
        with torch.no_grad():
            for i in range(0, n, batch_size):
                rows = len(x[i : i + batch_size])
                yb = model_inputs(y[i : i + batch_size], device)
                raw = call_module(module, model_inputs(x[i : i + batch_size], device))
                total_loss += _loss_sum(loss, loss_fn, raw, yb, rows)
                if classify:
                    correct += int((_predictions(raw).argmax(dim=1) == yb).sum())
                if extra:
                    outputs.append(to_host(raw))
    finally:
        module.train(was_training)
    if isinstance(loss, str) and loss in ("mse", "l1") and n:
        # reduction="sum" adds over every output element; report the per-element mean like torch.
        total_loss /= max(1, int(np.prod(y.shape[1:]))) if y.ndim > 1 else 1
    result = {"loss": total_loss / n if n else math.nan}
    if classify:
        result["accuracy"] = correct / n if n else math.nan
    if extra and n:
        targets = [y[i : i + batch_size] for i in range(0, n, batch_size)]
        result.update(extra_metrics(extra, outputs, targets))
    for name, builtin in (metrics or {}).items():  # aliases of built-in metrics
        if isinstance(builtin, str) and builtin in result:
            result[name] = result[builtin]
    return result
