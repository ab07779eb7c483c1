"""Checks run in the client before anything is submitted; each returns every problem it finds."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from dask_train.api._model import travel_problems
from dask_train.api._probe import check_module_output, probe_module
from dask_train.api._settings import Settings
from dask_train.data._blocks import is_dask_array
from dask_train.data._inputs import label
from dask_train.models._array import ArrayModel
from dask_train.models._evaluate import metric_names
from dask_train.models._frameworks import is_keras_model, keras_sparse_labels
from dask_train.models._torch import (
    LOSSES,
    OPTIMIZERS,
    is_classification,
    loss_name,
    primary_output,
    takes_weights,
)
from dask_train.policy._placement import check_role_counts
from dask_train.policy.callbacks import Callback
from dask_train.policy.stop import StopCondition

STRATEGIES = ("async-ps", "sync", "auto")


def _int_at_least(name: str, value: object, low: int) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return [f"{name}={value!r} is invalid: use an integer >= {low}."]
    return []


def _auto_or_int_at_least(name: str, value: object, low: int) -> list[str]:
    if isinstance(value, str) and value == "auto":
        return []
    return [p.replace("an integer", "'auto' or an integer") for p in _int_at_least(name, value, low)]


def _positive(name: str, value: object) -> list[str]:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return [f"{name}={value!r} is invalid: use a finite number > 0."]
    return []


def check_settings(settings: Settings) -> list[str]:
    """Problems with a Trainer's hyper-parameters (no data needed)."""
    s = settings
    problems: list[str] = []
    keras = is_keras_model(s.module)
    if not isinstance(s.module, (torch.nn.Module, ArrayModel)) and not keras:
        problems.append(
            f"module={type(s.module).__name__} is invalid: pass a torch.nn.Module instance, "
            "a Keras 3 model, or a dt.ArrayModel (with strategy='sync')."
        )
    problems += _check_strategy(s, keras=keras)
    loss = s.loss
    if keras:  # Keras losses, TensorFlow's devices (its own checks)
        from dask_train.models._keras_eval import check_settings as check_keras

        problems += check_keras(s.module, loss, device=s.device,
                                mixed_precision=s.mixed_precision)
    elif isinstance(loss, str) and loss not in LOSSES:
        problems.append(
            f"loss={loss!r} is unknown: use one of {sorted(LOSSES)}, a torch.nn loss module "
            "(e.g. torch.nn.CrossEntropyLoss(label_smoothing=0.1)) or a function "
            "fn(output, target) -> scalar tensor.")
    elif not isinstance(loss, str) and not callable(loss):
        problems.append(
            f"loss={loss!r} is invalid: pass a loss name, a torch.nn loss module or a function "
            "fn(output, target) -> scalar tensor.")
    optimizer = s.optimizer
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        if optimizer in (torch.optim.LBFGS,):
            problems.append(
                f"optimizer={optimizer.__name__} is invalid: it needs a closure over the whole "
                "model; use an element-wise optimizer such as torch.optim.SGD or Adam.")
        else:
            problems += _check_optimizer_options(optimizer, s.lr, s.optimizer_options)
    elif optimizer not in OPTIMIZERS:
        problems.append(
            f"optimizer={optimizer!r} is unknown: use one of {sorted(OPTIMIZERS)} or a "
            "torch.optim.Optimizer subclass such as torch.optim.SGD."
        )
    else:
        problems += _check_optimizer_options(optimizer, s.lr, s.optimizer_options)
    problems += _positive("lr", s.lr)
    # Servers exist only in async-ps; sync ignores ps.
    min_ps = 0 if s.strategy == "sync" else 1
    # ps="auto" is resolved at fit time (api._auto_ps); any other value must be a count.
    ps = min_ps if s.ps == "auto" else s.ps
    problems += [p.replace("use an integer", "use 'auto' or an integer") if p.startswith("ps=") else p
                 for p in check_role_counts(ps=ps, worker=s.workers, scorer=s.scorer,
                                            min_ps=min_ps)]
    problems += _int_at_least("batch_size", s.batch_size, 1)
    problems += _check_global_batch(s)
    problems += _int_at_least("epochs", s.epochs, 1)
    problems += _auto_or_int_at_least("blocks_ahead", s.blocks_ahead, 1)
    problems += _int_at_least("grad_accumulation", s.grad_accumulation, 1)
    prefetch = s.prefetch
    if isinstance(prefetch, bool):
        prefetch = int(prefetch)
    if prefetch != "auto":
        problems += [p.replace("an integer", "'auto', True, False or an integer")
                     for p in _int_at_least("prefetch", prefetch, 0)]
    problems += _int_at_least("seed", s.seed, 0)
    problems += _positive("score_every", s.score_every)
    problems += _positive("timeout", s.timeout)
    for i, cond in enumerate(s.stop):
        if not isinstance(cond, StopCondition):
            problems.append(
                f"stop[{i}]={cond!r} is invalid: use dt.StopAtScore, dt.StopAtStep, dt.StopAfter "
                "or dt.EarlyStopping."
            )
    for i, cb in enumerate(s.callbacks):
        if not isinstance(cb, Callback):
            problems.append(f"callbacks[{i}]={cb!r} is invalid: subclass dt.Callback.")
    problems += _check_recovery(s)
    problems += check_metrics(s.metrics, s.module, s.loss)
    problems += check_device(s.device, s.mixed_precision, s.module)
    return problems


def _check_strategy(s: Settings, *, keras: bool) -> list[str]:
    """Problems with ``strategy=``, ``ps="auto"`` (both measure torch modules) and the
    scorer's ``scorer_budget=``."""
    problems = []
    if s.strategy not in STRATEGIES:
        problems.append(f"strategy={s.strategy!r} is unknown: use one of {list(STRATEGIES)} "
                        "('auto': the fastest of async-ps, sync and one process, measured on "
                        "the cluster).")
    elif s.strategy == "auto" and keras:
        problems.append("strategy='auto' measures torch modules only: give a Keras model's "
                        "job strategy='async-ps' or 'sync'.")
    if s.ps == "auto" and keras:
        problems.append("ps='auto' measures torch modules only: give a Keras model's job a "
                        "server count, e.g. ps=1.")
    budget = s.scorer_budget
    if not (budget is None or isinstance(budget, str) and budget == "auto") and \
            (isinstance(budget, bool) or _positive("scorer_budget", budget)):
        problems.append(f"scorer_budget={budget!r} is invalid: use 'auto' (1/(workers + 1) of "
                        "a core), a share of one core > 0 (e.g. 0.25), or None (no limit).")
    return problems


DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = (False, True, "bf16", "fp16")


def check_device(device: Any, mixed_precision: Any, module: Any) -> list[str]:
    """Problems with ``device=`` and ``mixed_precision=`` (whether the workers have GPUs is
    checked on the cluster, see ``runtime.probe_devices``)."""
    problems = []
    if not (device in DEVICES or (isinstance(device, str) and device.startswith("cuda:")
                                  and device[5:].isdigit())):
        problems.append(f"device={device!r} is invalid: use 'auto' (a GPU per worker when every "
                        "worker has one), 'cpu', 'cuda' or 'cuda:N'.")
    if not any(mixed_precision is p or mixed_precision == p for p in PRECISIONS) \
            or isinstance(mixed_precision, (int, float)) and not isinstance(mixed_precision, bool):
        problems.append(f"mixed_precision={mixed_precision!r} is invalid: use False, True (bf16 "
                        "where supported, else fp16 with loss scaling), 'bf16' or 'fp16'.")
    if isinstance(module, ArrayModel) and (device not in ("auto", "cpu") or mixed_precision):
        problems.append(f"device={device!r}, mixed_precision={mixed_precision!r} do not apply to a "
                        "dt.ArrayModel (numpy runs on the CPU): leave the defaults.")
    return problems


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


def _check_global_batch(s: Settings) -> list[str]:
    global_batch, workers = s.global_batch_size, s.workers
    if global_batch is None:
        return []
    problems = _int_at_least("global_batch_size", global_batch, 1)
    if problems or not isinstance(workers, int) or workers < 1:
        return problems
    if s.batch_size != 128:
        problems.append(f"batch_size={s.batch_size!r} and global_batch_size={global_batch!r} "
                        "are both given: pass one (batch_size is per trainer).")
    if global_batch % workers:
        problems.append(f"global_batch_size={global_batch} does not split evenly over "
                        f"workers={workers}: use a multiple of {workers}, e.g. "
                        f"{max(workers, global_batch - global_batch % workers)}.")
    return problems


ON_NAN = ("stop", "skip")


def _check_recovery(s: Settings) -> list[str]:
    from dask_train.checkpoint import CheckpointConfig
    from dask_train.policy._failure import FailureConfig

    problems = []
    if s.checkpoint is not None and not isinstance(s.checkpoint, CheckpointConfig):
        problems.append(
            f"checkpoint={s.checkpoint!r} is invalid: pass dt.CheckpointConfig(path, "
            "every_seconds=30, keep=3) or None."
        )
    if s.failure is not None and not isinstance(s.failure, FailureConfig):
        problems.append(
            f"failure={s.failure!r} is invalid: pass dt.FailureConfig(max_failures=3) or None."
        )
    if s.on_nan not in ON_NAN:
        problems.append(
            f"on_nan={s.on_nan!r} is invalid: use 'stop' (end the job, keep the last good "
            "checkpoint) or 'skip' (leave the batch or score out and go on)."
        )
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


#: What torch's Optimizer says when given no parameters: raised after the subclass's own checks.
_NO_PARAMETERS = "empty parameter list"


def _check_optimizer_options(name: Any, lr: Any, options: Mapping[str, Any]) -> list[str]:
    """The optimizer's own checks of ``lr`` and ``options``, without building one.

    Each torch optimizer checks its arguments (unknown names, a negative rate, Nesterov without
    momentum) before ``Optimizer.__init__`` takes the parameters; given none, that raises right
    after. Building a real one would import ``torch._dynamo`` (``add_param_group`` is wrapped
    by ``torch._disable_dynamo``): 3 s of the client's start-up here, for a check.
    """
    cls: Any = OPTIMIZERS[name] if isinstance(name, str) else name
    try:
        cls([], lr=lr, **dict(options))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ValueError) and _NO_PARAMETERS in str(exc):
            return []  # every check of the arguments passed
        return [f"optimizer_options={dict(options)!r} are invalid for {name!r}: {exc}."]
    return []


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


def job_metrics(module: Any, loss: Any, metrics: Mapping[str, Any] | None = None) -> list[str]:
    """The metrics a job's scores will hold."""
    if isinstance(module, ArrayModel):
        return ["loss"] + (["accuracy"] if module.predict is not None else [])
    if is_keras_model(module):
        from dask_train.models._keras_eval import metric_names as keras_metric_names

        return keras_metric_names(loss, metrics)
    return metric_names(loss, metrics)


def check_metrics(metrics: Any, module: Any, loss: Any) -> list[str]:
    """Problems with ``metrics=``: a mapping of names to built-in names, functions of
    (output, target), or objects with update/compute/reset."""
    if metrics is None:
        return []
    if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
        return [f"metrics={metrics!r} is invalid: pass a dict of name -> 'accuracy', a function "
                "fn(output, target) -> number, or a torchmetrics metric object."]
    if isinstance(module, ArrayModel):
        return [f"metrics={sorted(metrics)} is not available for a dt.ArrayModel: its scores hold "
                "loss (and accuracy with a predict function); drop metrics=."]
    problems = []
    for name, metric in metrics.items():
        if isinstance(metric, str):
            if metric not in job_metrics(module, loss):
                problems.append(
                    f"metrics[{name!r}]={metric!r} is not a metric of loss={loss_name(loss)}: "
                    f"use one of {job_metrics(module, loss)}, a function or a metric object.")
        elif not (callable(metric) or all(hasattr(metric, a) for a in ("update", "compute", "reset"))):
            problems.append(f"metrics[{name!r}]={metric!r} is invalid: use a function "
                            "fn(output, target) -> number or an object with update/compute/reset.")
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
    problems = check_settings(s)
    if resume and s.checkpoint is None:
        problems.append(
            "resume=True needs checkpoints to resume from: pass "
            "checkpoint=dt.CheckpointConfig(path) to the Trainer."
        )
    problems += check_data(X, y)
    problems += check_sample_weight(sample_weight, X, s.module, s.loss)
    problems += check_validation(validation, X, y)
    needs_scores = [c for c in s.stop if hasattr(c, "metric")]
    if needs_scores and validation is None:
        problems.append(
            f"stop={needs_scores!r} needs scores: pass validation=(X_val, y_val) to fit."
        )
    elif needs_scores and s.scorer == 0:
        problems.append(
            f"stop={needs_scores!r} needs scores but scorer=0: use scorer=1."
        )
    if not problems:
        problems += travel_problems(s.module, factory)
    if not problems and (isinstance(s.module, torch.nn.Module) or is_keras_model(s.module)):
        problems += check_module_output(s.module, typed(), y, s.loss, s.metrics)
    if not problems:
        problems += check_stop_metrics(s.stop, job_metrics(s.module, s.loss, s.metrics))
    if isinstance(s.module, ArrayModel):
        problems += check_array_model(s.module, s, X, y, resume=resume)
    return problems
