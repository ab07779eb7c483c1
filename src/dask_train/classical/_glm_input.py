"""Input checks of the GLM estimators: every problem found before the solver starts, reported at once.

In-memory input is checked here in the client. Dask input is checked lazily where possible (shape,
dtype, columns); the checks that need the values (NaN, label values) run as one tiny task per
persisted block, right after the blocks are persisted and before the first iteration.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dask.array as da
import numpy as np
import scipy.sparse
from pandas.api.types import is_numeric_dtype
from sklearn.exceptions import DataConversionWarning
from sklearn.utils.multiclass import type_of_target
from sklearn.utils.validation import validate_data

from dask_train.data import BlockSet, persist_data
from dask_train.data._blocks import as_dask_array
from dask_train.data._inputs import is_collection
from dask_train.data._persist import map_blocks_inplace
from dask_train.errors import InvalidInput

TASKS = ("classification", "regression", "count")
_MAX_LABELS = 1000  # distinct labels reported per block: enough to tell classes from a regression target


class InvalidInputType(InvalidInput, TypeError):
    """Features that cannot be converted to numbers (also a TypeError, as numpy raises)."""


@dataclass
class FitData:
    """Validated, persisted training data: labels already encoded for the loss."""

    data: BlockSet
    n_rows: int
    n_features: int
    classes: np.ndarray | None
    y_mean: float


def is_dask(obj: Any) -> bool:
    """Whether ``obj`` is a dask collection (array, DataFrame, Series)."""
    return is_collection(obj)


def _encode_labels(
    block: tuple[np.ndarray, np.ndarray], classes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    X, y = block
    # The class index: 0/1 for binary logistic regression, 0..k-1 for multinomial.
    return X, np.searchsorted(classes, y).astype(np.float64)


def _as_float_target(block: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    X, y = block
    return X, np.asarray(y, dtype=np.float64)


def _block_stats(block: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    """What validation needs to know of one block; a few hundred bytes back to the client."""
    X, y = block
    finite = np.isfinite(X)
    stats: dict[str, Any] = {
        "x_nan": int(np.isnan(X).sum()),
        "x_inf": int((~finite).sum() - np.isnan(X).sum()),
        "rows": int(len(y)),
    }
    if y.dtype.kind in "fc":
        stats["y_nan"] = int((~np.isfinite(y)).sum())
        stats["y_fractional"] = bool(np.any(np.isfinite(y) & (y != np.round(y))))
        stats["y_min"] = float(np.nanmin(y)) if y.size and not np.all(np.isnan(y)) else math.inf
        stats["y_sum"] = float(np.nansum(y))
    elif y.dtype.kind in "biu":
        stats.update(y_nan=0, y_fractional=False, y_min=float(y.min()) if y.size else math.inf,
                     y_sum=float(y.sum()))
    else:
        stats.update(y_nan=0, y_fractional=False, y_min=math.inf, y_sum=math.nan)
    labels = np.unique(y[~_isnan_any(y)]) if y.size else y[:0]
    stats["labels"] = labels[:_MAX_LABELS]
    stats["many_labels"] = len(labels) > _MAX_LABELS
    return stats


def _isnan_any(y: np.ndarray) -> np.ndarray:
    if y.dtype.kind in "fc":
        return np.isnan(y)
    return np.zeros(y.shape, bool)


def _label_problems(
    task: str, name: str, labels: np.ndarray, *, fractional: bool, many: bool, y_min: float
) -> list[str]:
    problems = []
    if task == "classification":
        if fractional or many:
            problems.append(
                "y has continuous values (Unknown label type: continuous): "
                f"{name} expects class labels; pass integer or string classes, or use a regressor."
            )
        elif len(labels) < 2:
            problems.append(
                f"y contains only one class ({labels[:1].tolist()}): {name} needs samples of at least "
                "2 classes in the data; pass data with two or more classes."
            )
    if task == "count" and y_min < 0:
        problems.append(
            f"y has negative values (smallest {y_min:g}): {name} models counts; pass y >= 0."
        )
    return problems


def check_local(
    est: Any, X: Any, y: Any, *, task: str, name: str
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None, list[str]]:
    """Check in-memory X and y in the client: ``(X, y_encoded, classes, problems)``."""
    problems: list[str] = []
    Xa = ya = classes = None
    if y is None:
        problems.append(
            f"{name} requires y to be passed, but the target y is None: pass one target per row of X."
        )
    if scipy.sparse.issparse(X):
        problems.append(
            "X is a scipy sparse matrix: sparse input is not supported; pass a dense array "
            "(X.toarray()) or a dask array."
        )
    else:
        try:
            Xa = validate_data(est, X, reset=True, dtype=[np.float64, np.float32],
                               ensure_all_finite=False)
        except TypeError as exc:
            raise InvalidInputType([
                f"X cannot be converted to numbers ({exc}): pass numeric features (encode "
                "categories first)."
            ]) from exc
        except ValueError as exc:
            problems.append(f"X is invalid: {exc}")
    if Xa is not None:
        problems += _nan_problems(int(np.isnan(Xa).sum()), int(np.isinf(Xa).sum()))
    if y is not None:
        ya, classes, y_problems = _local_target(y, task=task, name=name)
        problems += y_problems
        if Xa is not None and ya is not None and len(ya) != len(Xa):
            problems.append(
                f"y has {len(ya)} rows but X has {len(Xa)}: pass one target per row of X "
                "(inconsistent numbers of samples)."
            )
    return Xa, ya, classes, problems


def _nan_problems(n_nan: int, n_inf: int) -> list[str]:
    problems = []
    if n_nan:
        problems.append(
            f"X contains NaN ({n_nan} values): remove those rows or impute them (e.g. "
            "sklearn.impute.SimpleImputer) before fit."
        )
    if n_inf:
        problems.append(
            f"X contains infinity ({n_inf} values): remove those rows or clip the features before fit."
        )
    return problems


def _local_target(
    y: Any, *, task: str, name: str
) -> tuple[np.ndarray | None, np.ndarray | None, list[str]]:
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        warnings.warn(
            "A column-vector y was passed when a 1d array was expected; change its shape to "
            "(n_samples,), for example using ravel().",
            DataConversionWarning,
            stacklevel=4,
        )
        y = y[:, 0]
    if y.ndim != 1:
        return None, None, [f"y has shape {y.shape}: y should be a 1d array with one target per row of X."]
    if y.dtype.kind == "c":
        return None, None, ["y has complex values (Complex data not supported): pass real targets."]
    if task == "classification":
        kind = type_of_target(y) if y.size else "unknown"
        if kind not in ("binary", "multiclass"):
            return None, None, [
                f"y has label type {kind!r} (Unknown label type: {kind}): {name} expects class "
                "labels; pass integer or string classes, or use a regressor."
            ]
        classes = np.unique(y)
        problems = _label_problems(task, name, classes, fractional=False, many=False, y_min=0.0)
        return np.searchsorted(classes, y).astype(np.float64), classes, problems
    try:
        yf = y.astype(np.float64)
    except (TypeError, ValueError) as exc:
        return None, None, [f"y cannot be converted to numbers ({exc}): pass numeric targets."]
    problems = []
    if not np.all(np.isfinite(yf)):
        problems.append("y contains NaN or infinity: remove those rows before fit.")
    finite = yf[np.isfinite(yf)]
    if finite.size:
        problems += _label_problems(task, name, finite[:0], fractional=False, many=False,
                                    y_min=float(finite.min()))
    return yf, None, problems


def _dask_inputs(est: Any, X: Any, y: Any, name: str) -> tuple[da.Array | None, da.Array | None, list[str]]:
    """Lazy checks of dask X and y: nothing is computed but unknown partition lengths."""
    problems = []
    if y is None:
        problems.append(
            f"{name} requires y to be passed, but the target y is None: pass one target per row of X."
        )
    dtypes = getattr(X, "dtypes", None)
    if dtypes is not None and hasattr(X, "columns"):  # a dask DataFrame
        bad = [str(c) for c, t in dtypes.items() if not is_numeric_dtype(t)]
        if bad:
            problems.append(
                f"X has non-numeric columns {bad}: pass numeric columns only (select them, or "
                "encode the categories first)."
            )
            return None, None, problems
        est.feature_names_in_ = np.asarray([str(c) for c in X.columns], dtype=object)
    elif hasattr(est, "feature_names_in_"):
        del est.feature_names_in_
    Xd = as_dask_array(X)
    yd = None if y is None else as_dask_array(y)
    if Xd.ndim != 2:
        problems.append(f"X has {Xd.ndim} dimension(s): pass a 2-D array (rows, features); "
                        "reshape your data with X.reshape(-1, 1) for a single feature.")
    elif Xd.dtype.kind == "c":
        problems.append("X has complex values (Complex data not supported): pass real features.")
    elif Xd.dtype.kind not in "biuf":
        problems.append(f"X has dtype {Xd.dtype}: pass numeric features (encode categories first).")
    if yd is not None and yd.ndim == 2 and yd.shape[1] == 1:
        yd = yd[:, 0]
    if yd is not None and yd.ndim != 1:
        problems.append(f"y has shape {yd.shape}: y should be a 1d array with one target per row of X.")
    if problems:
        return None, None, problems
    assert yd is not None
    if any(math.isnan(c) for c in Xd.chunks[0]):
        Xd = Xd.compute_chunk_sizes()
    if any(math.isnan(c) for c in yd.chunks[0]):
        yd = yd.compute_chunk_sizes()
    if yd.shape[0] != Xd.shape[0]:
        problems.append(
            f"y has {yd.shape[0]} rows but X has {Xd.shape[0]}: pass one target per row of X "
            "(inconsistent numbers of samples)."
        )
    if Xd.shape[0] == 0:
        problems.append("X has 0 samples: pass at least one row (n_samples=0).")
    return Xd, yd, problems


def prepare_fit(
    est: Any, X: Any, y: Any, *, task: str, client: Callable[[], Any], problems: list[str]
) -> FitData:
    """Check X and y, persist them on the workers and encode the labels; raise all problems at once.

    Parameters
    ----------
    est : estimator
        Gets ``n_features_in_`` (and ``feature_names_in_`` for DataFrames).
    task : str
        ``"classification"`` (labels -> class index), ``"regression"`` or ``"count"`` (y >= 0).
    client : callable
        Returns the client; called only once the input passed the checks that need no cluster.
    problems : list of str
        Problems found already (the hyper-parameters), raised together with those of the data.
    """
    name = type(est).__name__
    if not (is_dask(X) or is_dask(y)):
        Xa, ya, classes, more = check_local(est, X, y, task=task, name=name)
        if problems or more:
            raise InvalidInput(problems + more)
        assert Xa is not None and ya is not None
        data = persist_data(Xa, ya, client=client())
        return FitData(data, len(Xa), Xa.shape[1], classes, float(ya.mean()) if ya.size else 0.0)
    Xd, yd, more = _dask_inputs(est, X, y, name)
    if problems or more:
        raise InvalidInput(problems + more)
    assert Xd is not None and yd is not None
    est.n_features_in_ = int(Xd.shape[1])
    cluster = client()
    data = persist_data(Xd, yd, client=cluster)
    try:
        stats = cluster.gather(cluster.map(_block_stats, data.futures, pure=False))
        classes, problems = _stats_problems(stats, task=task, name=name)
        if problems:
            raise InvalidInput(problems)
        if classes is not None:
            map_blocks_inplace(data, _encode_labels, classes)
        else:
            map_blocks_inplace(data, _as_float_target)
    except BaseException:
        data.release()
        raise
    y_sum = sum(s["y_sum"] for s in stats)
    return FitData(data, data.n_rows, data.n_features, classes, y_sum / max(1, data.n_rows))


def _stats_problems(
    stats: list[dict[str, Any]], *, task: str, name: str
) -> tuple[np.ndarray | None, list[str]]:
    problems = _nan_problems(sum(s["x_nan"] for s in stats), sum(s["x_inf"] for s in stats))
    if sum(s["y_nan"] for s in stats):
        problems.append("y contains NaN or infinity: remove those rows before fit.")
    labels = np.unique(np.concatenate([s["labels"] for s in stats])) if stats else np.array([])
    many = any(s["many_labels"] for s in stats) or len(labels) > _MAX_LABELS
    fractional = any(s["y_fractional"] for s in stats)
    y_min = min((s["y_min"] for s in stats), default=math.inf)
    problems += _label_problems(task, name, labels, fractional=fractional, many=many, y_min=y_min)
    classes = labels if task == "classification" else None
    return classes, problems


__all__ = ["TASKS", "FitData", "InvalidInputType", "check_local", "is_dask", "prepare_fit"]
