"""Checks that run the user's module before anything is submitted: on a probe batch shaped like
``X``, its output must fit the loss, the targets and each metric of ``metrics=``."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dask_train.data._inputs import label
from dask_train.models._evaluate import is_metric_object
from dask_train.models._frameworks import is_keras_model
from dask_train.models._outputs import describe, to_host
from dask_train.models._torch import (
    call_module,
    is_classification,
    loss_name,
    model_inputs,
    primary_output,
    resolve_loss,
)

if TYPE_CHECKING:
    import dask.array as da


def probe_module(module: torch.nn.Module, sample_shape: tuple[int, ...],
                 dtype: Any = np.float32) -> torch.Tensor:
    """The module's output on two zero samples of ``dtype``, in eval mode, without gradients."""
    if is_keras_model(module):
        from dask_train.models._keras_eval import predict

        return torch.from_numpy(predict(module, np.zeros((2, *sample_shape), dtype=dtype)))
    sample = model_inputs(np.zeros((2, *sample_shape), dtype=dtype))
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            out: torch.Tensor = call_module(module, sample)
    finally:
        module.train(was_training)
    return out


def check_module_output(module: torch.nn.Module, X: da.Array, y: da.Array, loss: Any,
                        metrics: Mapping[str, Any] | None = None) -> list[str]:
    """Run the module on two zero samples and check its output fits the loss, y and the metric
    functions."""
    if is_keras_model(module):  # built here first when it is not yet, as Keras does
        from dask_train.models._keras_eval import check_output

        return check_output(module, tuple(X.shape[1:]), X.dtype, tuple(y.shape), y.dtype, loss)
    sample = np.zeros((2, *X.shape[1:]), dtype=X.dtype)
    try:
        out = probe_module(module, tuple(X.shape[1:]), X.dtype)
    except Exception as exc:  # any failure here is the user's module not fitting X
        return [
            f"module failed on a batch shaped like X {_shape_of(sample)}: "
            f"{type(exc).__name__}: {exc}. Make its input size match X's features."
        ]
    problems = _check_loss_output(out, y, loss)
    return problems + check_metric_functions(metrics, out, y) if not problems else problems


def _shape_of(sample: np.ndarray) -> str:
    """A sample batch's shape, by field for several inputs."""
    if sample.dtype.names is None:
        return str(tuple(sample.shape))
    return describe(model_inputs(sample))


def _check_loss_output(out: Any, y: da.Array, loss: Any) -> list[str]:
    """Problems with ``loss`` on the module's probe output ``out`` and targets shaped like y."""
    if y.dtype.names is not None and isinstance(loss, (str, torch.nn.Module)):
        return [f"loss={loss_name(loss)} reads one target tensor, but y holds several "
                f"({', '.join(label(n, 'y') for n in y.dtype.names)}): pass a function "
                "loss=fn(output, target) -> scalar tensor that reads each target by name, e.g. "
                "lambda out, t: cross_entropy(out['label'], t['label']) + "
                "mse_loss(out['value'], t['value'])."]
    if not isinstance(loss, (str, torch.nn.Module)):
        return _check_custom_loss(loss, out, y)  # a function of yours reads the whole output
    try:
        out = primary_output(out)
    except TypeError as exc:
        return [f"module output does not fit loss={loss_name(loss)}: {exc}."]
    if not isinstance(loss, str):
        return _check_custom_loss(loss, out, y)
    if is_classification(loss):
        if out.ndim != 2 or out.shape[1] < 2:
            return [
                f"module output shape {tuple(out.shape)} does not fit loss={loss!r}: it needs "
                "(batch, n_classes) scores with n_classes >= 2."
            ]
        if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
            return [
                f"y has dtype {y.dtype} and {y.ndim} dims but loss={loss!r} needs 1-D integer "
                "class labels: use y.astype('int64')."
            ]
        return []
    target = (2, *y.shape[1:])
    if tuple(out.shape) != target:
        return [
            f"module output shape {tuple(out.shape)} does not fit loss={loss!r} with y of shape "
            f"(n, {', '.join(map(str, y.shape[1:]))}): the output per sample must match y's, "
            f"i.e. {target}."
        ]
    return []


def _probe_target(y: Any, *, distinct: bool = False) -> Any:
    """Two targets shaped like y's rows, as the loss and metrics get them (a tensor, or a dict
    or tuple of tensors); ``distinct``: the rows differ (0 and 1), so a metric over one class
    only (an AUC) does not refuse them."""
    target = np.zeros((2, *y.shape[1:]), dtype=y.dtype)
    if distinct:
        for field in y.dtype.names or (None,):
            (target if field is None else target[field])[1] = 1
    return model_inputs(target)


def _check_custom_loss(loss: Any, out: Any, y: da.Array) -> list[str]:
    """Call a loss module or function on the probe's output and two targets shaped like y's."""
    target = _probe_target(y)
    try:
        value = resolve_loss(loss)(out, target)
    except Exception as exc:  # the user's loss does not fit the module's output and y
        return [f"loss={loss_name(loss)} failed on the module's output {describe(out)} and "
                f"targets shaped like y {describe(target)} ({y.dtype}): {type(exc).__name__}: "
                f"{exc}. Make the loss take (output, target) as the module and y give them."]
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        return [f"loss={loss_name(loss)} returned {type(value).__name__} "
                f"{tuple(getattr(value, 'shape', ()))}: return a scalar tensor (a batch mean)."]
    return []


def check_metric_functions(metrics: Mapping[str, Any] | None, out: Any, y: Any) -> list[str]:
    """Call each metric of ``metrics=`` on the module's probe output ``out`` and two targets
    shaped like y's, as the scorer will: a function gets the whole output, a metric object
    (reset/update/compute, on a copy) the predictions."""
    problems: list[str] = []
    out, target = to_host(out), _probe_target(y, distinct=True)
    for name, metric in (metrics or {}).items():
        if isinstance(metric, str) or not callable(metric) and not is_metric_object(metric):
            continue  # a built-in name, or invalid: check_metrics says so
        try:
            if is_metric_object(metric):
                try:
                    metric = copy.deepcopy(metric)  # the probe leaves the user's object as it was
                except Exception:  # an object that cannot be copied is checked when scored
                    continue
                metric.reset()
                metric.update(primary_output(out), target)
                value = metric.compute()
            else:
                value = metric(out, target)
        except Exception as exc:  # the user's metric not fitting the output or the target
            gets = "the predictions" if is_metric_object(metric) else "the model's whole output"
            problems.append(
                f"metrics[{name!r}] failed on the module's output {describe(out)} and targets "
                f"shaped like y {describe(target)}: {type(exc).__name__}: {exc}. A metric "
                f"function gets {gets} and the target (a dict of tensors for several targets) "
                f"and picks what it needs, e.g. metrics={{{name!r}: lambda out, target: "
                "(out['logits'].argmax(1) == target).float().mean()}.")
            continue
        try:
            float(value)
        except (TypeError, ValueError, RuntimeError):
            problems.append(f"metrics[{name!r}] returned {type(value).__name__} "
                            f"{describe(value)}: return a number (or a one-element tensor).")
    return problems
