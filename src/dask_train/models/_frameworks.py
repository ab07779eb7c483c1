"""Which framework a user's model or loss belongs to, asked without importing any framework.

A Keras model can only exist once ``keras`` is imported, so the check looks at ``sys.modules``:
``import dask_train`` and a torch job never pay for TensorFlow's import (20 s and more here).
When a Keras model is trained, :func:`import_tf` is the one place TensorFlow and Keras are
imported (by the Keras adapter, :mod:`._keras`, and its losses and checks, :mod:`._keras_eval`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: Keras losses that take integer class labels (the job then reports accuracy and checks labels).
SPARSE_LOSSES = frozenset({"sparse_categorical_crossentropy", "SparseCategoricalCrossentropy"})


def import_tf() -> tuple[Any, Any]:
    """``(tensorflow, keras)``, with TensorFlow's C++ INFO lines (CPU features, ...) kept out of
    the logs unless the user chose a level."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    import keras
    import tensorflow as tf

    return tf, keras


def is_keras_model(obj: Any) -> bool:
    """Whether ``obj`` is a Keras 3 model (``keras.Model``, so Sequential and functional ones too).

    Examples
    --------
    >>> is_keras_model(object())
    False
    """
    keras = sys.modules.get("keras")
    model = getattr(keras, "Model", None)
    return isinstance(model, type) and isinstance(obj, model)


def keras_sparse_labels(loss: Any) -> bool:
    """Whether ``loss`` is Keras's sparse categorical cross-entropy (integer class labels), as a
    name, the function or an instance.

    Examples
    --------
    >>> keras_sparse_labels("sparse_categorical_crossentropy"), keras_sparse_labels("mse")
    (True, False)
    """
    if isinstance(loss, str):
        return loss in SPARSE_LOSSES
    keras = sys.modules.get("keras")
    if keras is None:
        return False
    return loss is keras.losses.sparse_categorical_crossentropy or \
        isinstance(loss, keras.losses.SparseCategoricalCrossentropy)


def keras_param_count(model: Any) -> int:
    """Trainable values of a Keras model: the length of its flat parameter vector."""
    total = 0
    for v in model.trainable_weights:
        n = 1
        for d in v.shape:
            n *= int(d)
        total += n
    return total


def keras_float_dtype(model: Any) -> Any:
    """The numpy dtype of a Keras model's floating weights (float32 when it has none yet)."""
    import numpy as np

    kinds = [np.dtype(str(v.dtype)) for v in model.trainable_weights]
    return next((d for d in kinds if d.kind == "f"), np.dtype(np.float32))
