"""``dt.predict``: a trained model's outputs over a dask collection, computed where its blocks live.

The model is pickled once, here, into one graph key; each block's task depends on that key, so
Dask sends the bytes to a worker once (from the scheduler to the first worker, worker to worker
after that), and the task unpickles them at most once per worker process (see
:mod:`._worker`). ``X.map_blocks(model.predict)`` instead pickles the model into every task and
unpickles it for every block.

Because the model's bytes are an ordinary graph key (not scattered data), a worker lost
mid-prediction costs nothing but its blocks: Dask recomputes them, and the model key with them,
from the graph. The price is one copy of the bytes in the scheduler while the graph runs.
"""

from __future__ import annotations

import hashlib
import io
import sys
import warnings
from collections.abc import Callable
from typing import Any

import cloudpickle
import dask
import dask.array as da
import numpy as np
import pandas as pd

from dask_train.data._training import TrainingData
from dask_train.errors import InvalidInput
from dask_train.models._array import ArrayModel
from dask_train.prediction._worker import PredictSpec, predict_block, predict_partition, predict_rows

#: Methods of a torch module: its outputs, their argmax (class labels), their softmax.
TORCH_METHODS = ("forward", "argmax", "softmax")


def predict(model: Any, X: Any, *, method: str | None = None, batch_size: int = 4096,
            device: str | None = None, output: str | Callable[[Any], Any] | None = None) -> Any:
    """Predict with ``model`` over a dask collection, block by block where the blocks live.

    Parameters
    ----------
    model : torch.nn.Module, ArrayModel, or an estimator
        A torch module (its outputs in eval mode, without gradients), a
        :class:`~dask_train.ArrayModel` (its ``predict``), or any object with the method
        ``method`` taking rows: scikit-learn estimators, dask-train's GLMs, XGBoost models
        (``xgboost.dask`` models are converted to their local XGBoost class once, here).
    X : dask.array.Array, dask.dataframe.DataFrame, xarray object or array-like
        Rows to predict, read as ``Trainer.fit`` reads its ``X``: in-memory arrays wrapped
        into a dask array, an xarray ``DataArray`` or ``Dataset`` cut into rows along its first
        dimension (its other dimensions flattened into features), a dict or tuple of arrays as
        several inputs. Frames stay frames (pandas frames become a dask DataFrame).
    method : str, optional
        Torch modules: ``"forward"`` (default: the outputs), ``"argmax"`` (class labels) or
        ``"softmax"`` (class probabilities). Estimators: the method to call, default
        ``"predict"`` (``"predict_proba"``, ``"decision_function"``, ``"transform"``, ...).
    batch_size : int
        Rows per forward pass of a torch module (a block is split into batches of this size).
    device : str, optional
        Torch modules only: the device the workers run the model on, e.g. ``"cpu"`` or
        ``"cuda"``; default: the device of the model's parameters.
    output : str or callable, optional
        Torch modules whose forward returns more than one tensor (a dict, a tuple, a Hugging Face
        ``ModelOutput``): the field to predict (``output="logits"``) or a function of the output.
        Default: the output itself, its ``"logits"``, or a tuple's first element.

    Returns
    -------
    dask.array.Array, dask.dataframe.Series or dask.dataframe.DataFrame
        Lazy. For an array (or an xarray object), an array with X's row chunks (one output
        block per input block) and the model's output columns in one chunk. For a dask
        DataFrame, a Series (1-D outputs) or a DataFrame (2-D outputs, e.g.
        ``predict_proba``) with X's partitions and index, so it can be assigned as a column of
        the frame X came from.

    Raises
    ------
    InvalidInput
        Every problem with the arguments at once, or the model failing on X's first rows, before
        anything runs on the cluster.

    Examples
    --------
    >>> p = dt.predict(result.model, X, batch_size=4096)             # doctest: +SKIP
    >>> labels = dt.predict(result.model, X, method="argmax").compute()  # doctest: +SKIP
    >>> df["outcome"] = dt.predict(clf, df[features])                 # doctest: +SKIP
    """
    kind, local = _kind(model)
    method = method or ("forward" if kind == "torch" else "predict")
    problems = _problems(model, kind=kind, method=method, batch_size=batch_size, device=device)
    if problems:
        raise InvalidInput(problems)
    frame = _as_frame(X)
    data = frame if frame is not None else _as_rows(X)
    spec = _spec(local, data, kind=kind, method=method, batch_size=batch_size, device=device,
                 output=output)
    blob = _dumps(local, kind)
    token = hashlib.sha1(blob + spec.device.encode()).hexdigest()
    spec = PredictSpec(**{**spec.__dict__, "token": token})
    # One graph key holding the bytes: every block's task depends on it (see the module docstring).
    model_key = dask.delayed(blob, name=f"dt-model-{token}")
    if frame is not None:
        return frame.map_partitions(predict_partition, model_key, spec, meta=_frame_meta(frame, spec),
                                    token="dt-predict")
    return _map_array(data, model_key, spec)


def _kind(model: Any) -> tuple[str, Any]:
    """("torch" | "array" | "estimator", the object to send)."""
    torch = sys.modules.get("torch")  # a torch module exists only if torch is imported
    if torch is not None and isinstance(model, torch.nn.Module):
        return "torch", model
    if isinstance(model, ArrayModel):
        return "array", model
    return "estimator", _local_xgboost(model)


def _local_xgboost(model: Any) -> Any:
    """An ``xgboost.dask`` model as its local XGBoost class (same booster): the dask classes
    predict through a client, which a worker's task must not need."""
    cls = type(model)
    if not cls.__module__.startswith("xgboost.dask") or not cls.__name__.startswith("Dask"):
        return model
    import xgboost

    local = getattr(xgboost, cls.__name__.removeprefix("Dask"))()
    buffer = model.get_booster().save_raw("ubj")
    local.load_model(bytearray(buffer))
    if hasattr(model, "n_classes_"):
        local.n_classes_ = model.n_classes_
    return local


def _problems(model: Any, *, kind: str, method: str, batch_size: Any, device: Any) -> list[str]:
    problems = []
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        problems.append(f"batch_size={batch_size!r} is invalid: use an integer >= 1.")
    if kind == "torch":
        if method not in TORCH_METHODS:
            problems.append(f"method={method!r} is invalid for a torch module: use one of "
                            f"{', '.join(map(repr, TORCH_METHODS))}.")
        if device is not None:
            import torch

            try:
                torch.device(device)
            except (RuntimeError, TypeError) as exc:
                problems.append(f"device={device!r} is invalid ({exc}): use e.g. 'cpu' or 'cuda'.")
    elif device is not None:
        problems.append(f"device={device!r} applies to torch modules only: leave it out for a "
                        f"{type(model).__name__}.")
    if kind == "array" and method != "predict":
        problems.append(f"method={method!r} is invalid for an ArrayModel: use 'predict'.")
    if kind == "array" and model.predict is None:
        problems.append("this ArrayModel has no predict function: pass predict= to dt.ArrayModel.")
    if kind == "estimator" and not callable(getattr(model, method, None)):
        problems.append(f"model={type(model).__name__} has no method {method!r}: pass a torch "
                        "module, a dt.ArrayModel, or an estimator with that method (e.g. "
                        "method='predict' or 'predict_proba').")
    return problems


def _as_frame(X: Any) -> Any:
    """X as a dask DataFrame if it is a (dask or pandas) DataFrame or Series, else None.

    Frames keep a road of their own, which training has no counterpart for:
    ``TrainingData.of`` reads a frame as an array of its values (training needs no index),
    while predict returns one output partition per partition of X, with X's index, so that it
    can be assigned as a column of the frame X came from (a Parquet table written back with its
    predictions), and an estimator fitted on a frame gets the columns it checks by name.
    """
    import dask.dataframe as dd

    if isinstance(X, (pd.DataFrame, pd.Series)):
        # As many rows a partition as as_dask_array puts in a block of an in-memory array.
        X = dd.from_pandas(X, chunksize=100_000)
    if isinstance(X, dd.Series):
        return X.to_frame()
    return X if isinstance(X, dd.DataFrame) else None


def _as_rows(X: Any) -> da.Array:
    """Any other X as a dask array of rows, made as training makes its ``X``: the same road
    (:meth:`TrainingData.of`) for dask and numpy arrays, xarray objects and several inputs."""
    X = TrainingData.of(X).X
    # Whole rows per block: every output block is computed from one input block.
    return X.rechunk({axis: -1 for axis in range(1, X.ndim)}) if X.ndim > 1 else X


def _first_rows(data: Any) -> Any:
    if isinstance(data, da.Array):
        return data[: min(2, data.shape[0])].compute()
    with warnings.catch_warnings():  # "insufficient elements": a short first partition is fine
        warnings.simplefilter("ignore")
        return data.head(2)


def _spec(model: Any, data: Any, *, kind: str, method: str, batch_size: int,
          device: str | None, output: Any = None) -> PredictSpec:
    """The tasks' settings; the output's shape and dtype from the model run here on X's first
    rows (which also catches a model that does not fit X before anything is submitted)."""
    in_dtype = ""
    if kind == "torch":
        params = [p for p in model.parameters() if p.is_floating_point()]
        in_dtype = str(params[0].dtype).removeprefix("torch.") if params else ""
        where = str(params[0].device) if params else "cpu"
        device = str(device or where)
    elif kind == "array":
        in_dtype = "float64"
    spec = PredictSpec(token="", kind=kind, method=method, batch_size=batch_size,
                       device=device or "", in_dtype=in_dtype, out_shape=(), out_dtype="",
                       name=method if kind == "estimator" else "prediction", output=output)
    rows = _first_rows(data)
    if isinstance(rows, pd.DataFrame) and not (kind == "estimator" and
                                               hasattr(model, "feature_names_in_")):
        rows = rows.to_numpy(dtype=in_dtype or None)
    try:
        out = _probe(model, rows, spec, where=device if kind == "torch" else None)
    except Exception as exc:  # the user's model not fitting the data: report it as input
        shape = getattr(data, "shape", None)
        raise InvalidInput([
            f"the model failed on the first rows of X (shape {shape}): {type(exc).__name__}: "
            f"{exc}. Pass the columns, dtype and shape the model was trained on."
        ]) from exc
    columns: tuple[Any, ...] = ()
    classes = getattr(model, "classes_", None)
    if out.ndim == 2 and classes is not None and len(classes) == out.shape[1]:
        columns = tuple(np.asarray(classes).tolist())
    return PredictSpec(**{**spec.__dict__, "out_shape": tuple(int(s) for s in out.shape[1:]),
                          "out_dtype": str(out.dtype), "columns": columns})


def _probe(model: Any, rows: Any, spec: PredictSpec, *, where: str | None) -> np.ndarray:
    if spec.kind != "torch":
        return np.asarray(predict_rows(model, rows, spec))
    # The user's module in eval mode for the probe only (no BatchNorm statistics updated), on
    # the device it lives on here.
    params = [p for p in model.parameters()]
    here = PredictSpec(**{**spec.__dict__, "device": str(params[0].device) if params else "cpu"})
    if len(rows) == 0:
        rows = np.zeros((1, *rows.shape[1:]), dtype=rows.dtype)
    was_training = model.training
    model.eval()
    try:
        return predict_rows(model, rows, here)
    finally:
        model.train(was_training)


def _dumps(model: Any, kind: str) -> bytes:
    """The model's bytes: cloudpickle (classes defined in a script travel by value); a torch
    module through ``torch.save`` so the workers can load it with ``map_location``."""
    if kind != "torch":
        return bytes(cloudpickle.dumps(model, protocol=5))
    import torch

    buffer = io.BytesIO()
    torch.save(model, buffer, pickle_module=cloudpickle)
    return buffer.getvalue()


def _map_array(X: da.Array, model_key: Any, spec: PredictSpec) -> da.Array:
    out_ndim = 1 + len(spec.out_shape)
    chunks = (X.chunks[0], *((s,) for s in spec.out_shape))
    axes: dict[str, Any] = {}
    if out_ndim < X.ndim:
        axes["drop_axis"] = list(range(out_ndim, X.ndim))
    elif out_ndim > X.ndim:
        axes["new_axis"] = list(range(X.ndim, out_ndim))
    meta = np.empty((0,) * out_ndim, dtype=spec.out_dtype)
    out: da.Array = da.map_blocks(predict_block, X, model_key, spec, dtype=spec.out_dtype,
                                  chunks=chunks, meta=meta, token="dt-predict", **axes)
    return out


def _frame_meta(frame: Any, spec: PredictSpec) -> Any:
    index = frame._meta.index
    if not spec.out_shape:
        return pd.Series(np.empty(0, dtype=spec.out_dtype), index=index, name=spec.name)
    width = int(np.prod(spec.out_shape))
    columns = list(spec.columns) if spec.columns else list(range(width))
    return pd.DataFrame(np.empty((0, width), dtype=spec.out_dtype), index=index, columns=columns)
