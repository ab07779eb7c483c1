"""Worker side of :func:`dask_train.predict`: one task per block, the model unpickled once per worker.

Every block's task depends on one graph key holding the model's bytes. Dask fetches those bytes to
a worker the first time one of its tasks needs them (worker to worker, after the first); the task
then unpickles the model only when this worker process has not done so already: the deserialised
model is kept per process, by the token of its bytes (:func:`cached_model`). So a model is
unpickled at most once per worker however many blocks it predicts, and never pickled again after
the client's one ``dumps``.
"""

from __future__ import annotations

import collections
import io
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from dask_train.runtime._plugin import worker_state

#: Deserialised models kept per worker process, newest last; the oldest goes first.
KEEP_MODELS = 4

# Outside a Dask worker (dask's local schedulers): one cache for the process.
_LOCAL_OBJECTS: collections.OrderedDict[str, Any] = collections.OrderedDict()
_LOCAL_LOCK = threading.Lock()


@dataclass(frozen=True)
class PredictSpec:
    """What a block's task needs besides the model's bytes and the block (small, msgpack-able).

    ``kind`` is ``"torch"``, ``"array"`` (an ArrayModel) or ``"estimator"`` (anything with the
    method ``method``); ``out_shape``/``out_dtype`` describe one row of output, for empty blocks;
    ``in_dtype`` is the dtype floating inputs take (a torch module's parameters), or "".
    """

    token: str
    kind: str
    method: str
    batch_size: int
    device: str
    in_dtype: str
    out_shape: tuple[int, ...]
    out_dtype: str
    name: str = "prediction"
    columns: tuple[Any, ...] = ()
    #: Torch modules: the field of a structured output to predict, a function of it, or None.
    output: Any = None


def cached_model(token: str, blob: bytes, load: Callable[[bytes], Any]) -> Any:
    """The object ``load(blob)``, loaded at most once per process for a given ``token``."""
    try:
        state = worker_state()
        objects, lock = state.objects, state.objects_lock
    except ValueError:  # not inside a Dask worker
        objects, lock = _LOCAL_OBJECTS, _LOCAL_LOCK
    # Held while loading: a second thread of this worker must wait for the first load, not
    # unpickle the same model again.
    with lock:
        model = objects.get(token)
        if model is None:
            model = load(blob)
            objects[token] = model
            while len(objects) > KEEP_MODELS:
                objects.popitem(last=False)
        else:
            objects.move_to_end(token)
    return model


def _loader(spec: PredictSpec) -> Callable[[bytes], Any]:
    if spec.kind != "torch":
        return pickle.loads

    def load(blob: bytes) -> Any:
        import torch

        try:
            worker_state().configure_torch()  # the worker's threads, not the nanny's 1
        except ValueError:
            pass
        # map_location: a model saved from a GPU loads onto the device asked for (or where it was).
        module = torch.load(io.BytesIO(blob), map_location=spec.device, weights_only=False)
        module.eval()
        return module

    return load


def _torch_outputs(module: Any, x: np.ndarray, spec: PredictSpec) -> np.ndarray:
    import torch

    from dask_train.data._inputs import cast_floats
    from dask_train.models._torch import call_module, model_inputs, select_output

    if spec.in_dtype:  # several inputs (records): their floating fields
        x = cast_floats(x, spec.in_dtype)
    x = np.ascontiguousarray(x)
    outputs = []
    with torch.inference_mode():
        for start in range(0, len(x), spec.batch_size):
            batch = model_inputs(x[start : start + spec.batch_size], spec.device)
            out = select_output(call_module(module, batch), spec.output)
            if spec.method == "argmax":
                out = out.argmax(dim=1)
            elif spec.method == "softmax":
                out = torch.softmax(out, dim=1)
            outputs.append(out.to("cpu"))
    if not outputs:
        return np.empty((0, *spec.out_shape), dtype=spec.out_dtype)
    return torch.cat(outputs).numpy()


def predict_rows(model: Any, x: Any, spec: PredictSpec) -> np.ndarray:
    """The outputs of an already-loaded ``model`` on the rows ``x`` (also used by the client's
    probe on the first rows, so the probe and the tasks run the same code)."""
    if spec.kind == "torch":
        return _torch_outputs(model, np.asarray(x), spec)
    if len(x) == 0:
        return np.empty((0, *spec.out_shape), dtype=spec.out_dtype or np.float64)
    if spec.kind == "array":
        return np.asarray(model.predict(model.params, np.asarray(x)))
    return np.asarray(getattr(model, spec.method)(x))


def predict_block(x: np.ndarray, blob: bytes, spec: PredictSpec) -> np.ndarray:
    """Dask task: the model's outputs on one block of a dask array, in batches."""
    model = cached_model(spec.token, blob, _loader(spec))
    out = predict_rows(model, x, spec)
    return out.astype(spec.out_dtype, copy=False) if spec.out_dtype else out


def predict_partition(part: pd.DataFrame, blob: bytes, spec: PredictSpec) -> Any:
    """Dask task: one partition of a dask DataFrame -> a Series (or a DataFrame for 2-D outputs)
    with the partition's index."""
    model = cached_model(spec.token, blob, _loader(spec))
    # An estimator fitted on a frame gets the frame (it checks the feature names); one fitted on
    # an array, torch and numpy models get its values.
    named = spec.kind == "estimator" and hasattr(model, "feature_names_in_")
    x = part if named else part.to_numpy(dtype=spec.in_dtype or None)
    out = predict_rows(model, x, spec)
    out = out.astype(spec.out_dtype, copy=False) if spec.out_dtype else out
    if out.ndim == 1:
        return pd.Series(out, index=part.index, name=spec.name)
    return pd.DataFrame(out.reshape(len(out), -1), index=part.index,
                        columns=list(spec.columns) or None)


def models_here(dask_worker: Any = None) -> list[str]:
    """Tokens of the models this worker process holds, oldest first (``client.run(models_here)``)."""
    objects = worker_state(dask_worker).objects if dask_worker is not None else _LOCAL_OBJECTS
    return list(objects)
