"""Keras losses, scores and the checks run on a Keras model before a job starts.

Keras conventions throughout: a loss or metric function takes ``(y_true, y_pred)``; a loss is a
Keras name (``"sparse_categorical_crossentropy"``), a ``keras.losses.Loss`` or such a function;
a metric object has ``reset_state``/``update_state``/``result``.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from dask_train.models._frameworks import import_tf, keras_sparse_labels

#: Torch loss names a Keras user might pass by habit, and the Keras loss to use instead.
_TORCH_NAMES = {
    "cross_entropy": "'sparse_categorical_crossentropy' (a softmax output) or "
                     "keras.losses.SparseCategoricalCrossentropy(from_logits=True) (logits)",
    "nll": "'sparse_categorical_crossentropy'",
    "l1": "'mean_absolute_error'",
}
_CATEGORICAL = frozenset({"categorical_crossentropy", "CategoricalCrossentropy"})
_BINARY = frozenset({"binary_crossentropy", "BinaryCrossentropy"})


def resolve_loss(loss: Any) -> Any:
    """A Keras loss function or ``Loss`` object for a name, object or function."""
    _, keras = import_tf()
    return keras.losses.get(loss) if isinstance(loss, str) else loss


def make_loss(loss: Any) -> Callable[..., Any]:
    """The engines' loss: ``fn(y_true, y_pred, weight=None)`` -> the batch loss (a scalar tensor).

    A ``keras.losses.Loss`` is called as Keras calls it (its own reduction, ``sample_weight``).
    A function gives per-sample losses (as Keras's own do): their mean, or with sample weights
    ``sum(weight_i * loss_i) / rows``, Keras's "sum over batch size", as the torch adapter does.
    """
    tf, keras = import_tf()
    fn = resolve_loss(loss)
    if isinstance(fn, keras.losses.Loss):
        def call(y_true: Any, y_pred: Any, weight: Any = None) -> Any:
            return fn(y_true, y_pred, sample_weight=weight)
        return call

    def per_sample(y_true: Any, y_pred: Any, weight: Any = None) -> Any:
        values = tf.cast(fn(y_true, y_pred), tf.float32)
        if values.shape.rank and values.shape.rank > 1:
            values = tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)
        if weight is None:
            return tf.reduce_mean(values)
        rows = tf.cast(tf.maximum(tf.shape(y_pred)[0], 1), tf.float32)
        return tf.reduce_sum(values * tf.cast(weight, tf.float32)) / rows

    return per_sample


def _kind(loss: Any) -> tuple[str | None, bool]:
    """(label kind, from_logits) of a loss: "sparse", "categorical", "binary" or None."""
    if keras_sparse_labels(loss):
        kind: str | None = "sparse"
    elif isinstance(loss, str):
        kind = "categorical" if loss in _CATEGORICAL else "binary" if loss in _BINARY else None
    else:
        _, keras = import_tf()
        kind = ("categorical" if loss is keras.losses.categorical_crossentropy
                or isinstance(loss, keras.losses.CategoricalCrossentropy) else
                "binary" if loss is keras.losses.binary_crossentropy
                or isinstance(loss, keras.losses.BinaryCrossentropy) else None)
    config = loss.get_config() if hasattr(loss, "get_config") else {}
    return kind, bool(config.get("from_logits", False))


def metric_names(loss: Any, metrics: Mapping[str, Any] | None) -> list[str]:
    """The keys a Keras job's score records hold: loss, accuracy for classification, extras."""
    names = ["loss"] + (["accuracy"] if _kind(loss)[0] else [])
    return names + [n for n in (metrics or {}) if n not in names]


def _correct(kind: str, from_logits: bool, out: np.ndarray, y: np.ndarray) -> int:
    if kind == "sparse":
        return int((out.argmax(axis=-1) == y.reshape(len(y), -1)[:, 0]).sum())
    if kind == "categorical":
        return int((out.argmax(axis=-1) == y.argmax(axis=-1)).sum())
    threshold = 0.0 if from_logits else 0.5
    return int(((out.reshape(len(out), -1) > threshold) ==
                (y.reshape(len(y), -1) > 0.5)).all(axis=1).sum())


def evaluate(forward: Callable[[np.ndarray], np.ndarray], x: np.ndarray, y: np.ndarray, *,
             loss: Any, metrics: Mapping[str, Any] | None = None, batch_size: int = 4096
             ) -> dict[str, float]:
    """Mean loss, accuracy for classification losses and ``metrics`` of a model on ``(x, y)``.

    ``forward`` gives the model's outputs (inference mode). The loss is the batch loss weighted by
    the batch's rows (exact for per-sample losses and "sum over batch size" reductions); metric
    objects are fed batch by batch, metric functions get every output at once.
    """
    fn = make_loss(loss)
    kind, logits = _kind(loss)
    objects = {k: m for k, m in (metrics or {}).items() if hasattr(m, "update_state")}
    functions = {k: m for k, m in (metrics or {}).items()
                 if not isinstance(m, str) and k not in objects}
    for metric in objects.values():
        metric.reset_state()
    outputs: list[np.ndarray] = []
    total, correct, n = 0.0, 0, len(x)
    for i in range(0, n, batch_size):
        xb, yb = np.ascontiguousarray(x[i : i + batch_size]), y[i : i + batch_size]
        out = forward(xb)
        total += float(fn(yb, out)) * len(xb)
        if kind:
            correct += _correct(kind, logits, out, yb)
        for metric in objects.values():
            metric.update_state(yb, out)
        if functions:
            outputs.append(out)
    result = {"loss": total / n if n else math.nan}
    if kind:
        result["accuracy"] = correct / n if n else math.nan
    for name, metric in objects.items():
        result[name] = float(np.asarray(metric.result()))
    if functions and n:
        out_all = np.concatenate(outputs)
        for name, metric in functions.items():
            result[name] = float(np.mean(np.asarray(metric(y, out_all))))
    for name, builtin in (metrics or {}).items():  # aliases of built-in metrics
        if isinstance(builtin, str) and builtin in result:
            result[name] = result[builtin]
    return result


def predict(model: Any, x: np.ndarray, *, batch_size: int = 4096) -> np.ndarray:
    """A Keras model's outputs on ``x`` (inference mode), batch by batch, as numpy."""
    import_tf()
    parts = [np.asarray(model(np.ascontiguousarray(x[i : i + batch_size]), training=False))
             for i in range(0, len(x), batch_size)]
    return np.concatenate(parts) if parts else np.empty((0,))


# -- checks before a job starts -------------------------------------------------------------------

def check_settings(module: Any, loss: Any, *, device: Any, mixed_precision: Any) -> list[str]:
    """Problems with training this Keras model with these settings (no data needed)."""
    _, keras = import_tf()
    problems = []
    if keras.backend.backend() != "tensorflow":
        problems.append(f"module is a Keras model on the {keras.backend.backend()!r} backend: "
                        "dask-train trains Keras models on TensorFlow; set KERAS_BACKEND="
                        "tensorflow before importing keras.")
    if isinstance(loss, str) and loss in _TORCH_NAMES:
        problems.append(f"loss={loss!r} is a torch loss name; for a Keras model use a Keras loss, "
                        f"e.g. {_TORCH_NAMES[loss]}.")
    elif isinstance(loss, str):
        try:
            keras.losses.get(loss)
        except ValueError:
            problems.append(f"loss={loss!r} is not a Keras loss name: use one such as "
                            "'sparse_categorical_crossentropy' or 'mean_squared_error', a "
                            "keras.losses.Loss, or a function fn(y_true, y_pred).")
    elif not callable(loss):
        problems.append(f"loss={loss!r} is invalid: pass a Keras loss name, a keras.losses.Loss "
                        "or a function fn(y_true, y_pred) -> per-sample losses.")
    if device not in ("auto", "cpu") or mixed_precision:
        problems.append(f"device={device!r}, mixed_precision={mixed_precision!r} do not apply to a "
                        "Keras model: TensorFlow places its computations; leave the defaults (for "
                        "mixed precision, build the model under a keras.mixed_precision policy).")
    if not module.trainable_weights and module.built:
        problems.append("module is a Keras model without trainable weights: nothing to train "
                        "(is model.trainable False?).")
    try:
        pickle.loads(pickle.dumps(module))
    except Exception as exc:  # the model cannot travel to the workers
        problems.append(f"module cannot be pickled ({type(exc).__name__}: {exc}), and the workers "
                        "receive it pickled: use built-in layers, or register custom ones with "
                        "@keras.saving.register_keras_serializable() in an importable module.")
    return problems


def build(module: Any, sample_shape: tuple[int, ...], dtype: Any) -> None:
    """Build an unbuilt model on two zero samples, as Keras does on its first call."""
    if not module.built or not module.trainable_weights:
        module(np.zeros((2, *sample_shape), dtype=dtype), training=False)


def check_output(module: Any, sample_shape: tuple[int, ...], dtype: Any, y_shape: tuple[int, ...],
                 y_dtype: Any, loss: Any) -> list[str]:
    """Build the model if needed, run it on two zero samples and call the loss on its output."""
    try:
        build(module, sample_shape, dtype)
        out = np.asarray(module(np.zeros((2, *sample_shape), dtype=dtype), training=False))
    except Exception as exc:  # any failure here is the user's model not fitting X
        return [f"module failed on a batch shaped like X {(2, *sample_shape)}: "
                f"{type(exc).__name__}: {exc}. Make its input shape match X's features."]
    if keras_sparse_labels(loss) and (len(y_shape) != 1 or np.dtype(y_dtype).kind not in "iu"):
        return [f"y has dtype {y_dtype} and {len(y_shape)} dims but loss={loss!r} needs 1-D "
                "integer class labels: use y.astype('int64')."]
    target = np.zeros((2, *y_shape[1:]), dtype=y_dtype)
    try:
        value = np.asarray(make_loss(loss)(target, out))
    except Exception as exc:  # the loss does not fit the model's output and y
        return [f"loss={getattr(loss, '__name__', loss)!r} failed on the model's output "
                f"{out.shape} and targets shaped like y {target.shape} ({y_dtype}): "
                f"{type(exc).__name__}: {exc}. Make the output match the loss and y."]
    if value.size != 1:
        return [f"loss={loss!r} gave {value.shape} on the model's output: return per-sample "
                "losses or a scalar."]
    return []


def output_width(module: Any, sample_shape: tuple[int, ...], dtype: Any) -> int:
    """The size of the model's output per sample (classes, for a classifier)."""
    out = np.asarray(module(np.zeros((2, *sample_shape), dtype=dtype), training=False))
    return int(out.reshape(len(out), -1).shape[1])
