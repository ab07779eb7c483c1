"""Evaluation of a torch module on held-out data: the loss, accuracy and the user's metrics."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

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


def extra_metrics(metrics: Mapping[str, Any] | None, outputs: list[Any],
                  targets: list[Any]) -> dict[str, float]:
    """``metrics`` over the whole validation set: a function of (output, target) -> number, or
    an object with ``reset``/``update``/``compute`` (a torchmetrics metric), fed batch by batch.
    ``outputs`` and ``targets`` are batches, as tensors or numpy arrays."""
    outputs = [torch.as_tensor(o) for o in outputs]
    targets = [torch.as_tensor(t) for t in targets]
    out: dict[str, float] = {}
    for name, metric in (metrics or {}).items():
        if isinstance(metric, str):
            continue  # a built-in name: computed by evaluate itself
        if all(hasattr(metric, a) for a in ("reset", "update", "compute")):
            metric.reset()
            for o, t in zip(outputs, targets):
                metric.update(o, t)
            value = metric.compute()
        else:
            value = metric(torch.cat(outputs), torch.cat(targets))
        out[name] = float(value)
    return out


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
    weighted by the batch's rows. ``metrics`` adds named metrics (see ``Trainer(metrics=)``).
    Batches go to ``device`` (the module's); metrics get the outputs and targets back on the host.
    """
    extra = {k: m for k, m in (metrics or {}).items() if not isinstance(m, str)}
    outputs: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    if isinstance(loss, torch.nn.Module) and device is not None:
        loss = loss.to(device)  # class weights go where the outputs are
    loss_fn = resolve_loss(loss)
    named = isinstance(loss, str)
    classify = is_classification(loss)
    picks = named or classify or bool(extra) or isinstance(loss, torch.nn.Module)
    was_training = module.training
    module.eval()
    total_loss, correct, n = 0.0, 0, len(x)
    try:
        with torch.no_grad():
            for i in range(0, n, batch_size):
                xb = model_inputs(x[i : i + batch_size], device)
                yb = model_inputs(y[i : i + batch_size], device)
                raw = call_module(module, xb)
                # The predictions, where something reads them: a loss function of yours alone
                # gets the whole output, which may have none to pick (a dict without "logits").
                out = primary_output(raw) if picks else raw
                if isinstance(out, torch.Tensor) and out.is_floating_point():
                    out = out.float()
                if named:
                    total_loss += float(loss_fn(out, yb, reduction="sum"))  # type: ignore[call-arg]
                else:  # a loss module reads the predictions, a function of yours the output
                    given = raw if not isinstance(raw, torch.Tensor) and \
                        not isinstance(loss, torch.nn.Module) else out
                    total_loss += float(loss_fn(given, yb)) * len(yb)
                if classify:
                    correct += int((out.argmax(dim=1) == yb).sum())
                if extra:
                    outputs.append(out.cpu())
                    targets.append(yb.cpu())
    finally:
        module.train(was_training)
    if named and loss in ("mse", "l1") and n:
        # reduction="sum" adds over every output element; report the per-element mean like torch.
        total_loss /= max(1, int(np.prod(y.shape[1:]))) if y.ndim > 1 else 1
    result = {"loss": total_loss / n if n else math.nan}
    if classify:
        result["accuracy"] = correct / n if n else math.nan
    if extra and n:
        result.update(extra_metrics(extra, outputs, targets))
    for name, builtin in (metrics or {}).items():  # aliases of built-in metrics
        if isinstance(builtin, str) and builtin in result:
            result[name] = result[builtin]
    return result
