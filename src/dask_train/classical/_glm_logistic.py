"""Logistic regression on a Dask cluster (binary or multinomial), on the shared GLM machinery."""

from __future__ import annotations

import math
import numbers
from typing import Any

import dask.array as da
import numpy as np
from sklearn.base import ClassifierMixin

from dask_train.classical._glm import _GLM
from dask_train.classical._glm_input import FitData, is_dask
from dask_train.classical._glm_losses import GLMBlockLoss
from dask_train.classical._solvers import SolverResult


class LogisticRegression(ClassifierMixin, _GLM):
    """Logistic regression fitted on a Dask cluster; binary or multinomial.

    Minimises scikit-learn's objective ``C * sum_i loss_i + penalty(w)`` with ``penalty`` =
    ``|w|^2 / 2`` (l2), ``|w|_1`` (l1), ``l1_ratio |w|_1 + (1 - l1_ratio) |w|^2 / 2`` (elasticnet)
    or nothing (none); the intercept is not penalised. With more than two classes the model is
    multinomial (softmax), as scikit-learn's.

    Parameters
    ----------
    penalty : {"l2", "l1", "elasticnet", "none"} or None
    C : float
        Inverse regularisation strength, > 0.
    l1_ratio : float
        Share of the L1 term with ``penalty="elasticnet"``, in [0, 1].
    solver : {"lbfgs", "newton", "gradient_descent", "proximal_grad"}
        ``lbfgs`` and ``gradient_descent`` need a smooth objective (none or l2); ``newton``
        (proximal Newton with an L1 term) and ``proximal_grad`` take every penalty.
    tol : float
        Stop when the largest entry of the (minimum-norm sub)gradient of the objective divided by
        the number of rows is at most ``tol``.
    max_iter : int
    fit_intercept : bool
    split_every : int
        Fan-in of the reduction tree of the partial sums.
    client : distributed.Client, optional
        Default: the current client, else a new embedded cluster (:func:`dask_train.connect`).

    Attributes
    ----------
    coef_ : ndarray of shape (1, n_features) or (n_classes, n_features)
    intercept_ : ndarray of shape (1,) or (n_classes,)
    classes_ : ndarray
    n_iter_ : int
    loss_history_ : list of float
        The objective (mean loss plus penalty / (C n)) after each iteration.
    time_history_ : list of float
        Seconds since ``fit`` started (checks and persisting the data included), after each
        iteration.

    Examples
    --------
    >>> import dask_train as dt
    >>> clf = dt.LogisticRegression(C=1.0, solver="lbfgs", client=client)  # doctest: +SKIP
    >>> clf.fit(X, y).predict_proba(X)                                      # doctest: +SKIP
    dask.array<...>
    """

    _task = "classification"

    def __init__(
        self,
        penalty: str | None = "l2",
        *,
        C: float = 1.0,
        l1_ratio: float = 0.5,
        solver: str = "lbfgs",
        tol: float = 1e-4,
        max_iter: int = 100,
        fit_intercept: bool = True,
        split_every: int = 2,
        client: Any = None,
    ) -> None:
        self.penalty = penalty
        self.C = C
        self.l1_ratio = l1_ratio
        self.solver = solver
        self.tol = tol
        self.max_iter = max_iter
        self.fit_intercept = fit_intercept
        self.split_every = split_every
        self.client = client

    def _strength_problems(self) -> list[str]:
        if not isinstance(self.C, numbers.Real) or isinstance(self.C, bool) or not self.C > 0:
            return [f"C={self.C!r} is invalid: use a number > 0 (smaller means a stronger penalty)."]
        return []

    def _penalty_weights(self, n_rows: int) -> tuple[float, float]:
        if self.penalty in (None, "none") or math.isinf(self.C):
            return 0.0, 0.0
        scale = 1.0 / (float(self.C) * n_rows)  # C * sum(loss) + r(w)  ==  n C (mean loss + r(w) / (n C))
        share = self._l1_share()
        return (1.0 - share) * scale, share * scale

    def _n_outputs(self, fd: FitData) -> int:
        assert fd.classes is not None
        return 1 if len(fd.classes) == 2 else len(fd.classes)

    def _family_for(self, fd: FitData) -> str:
        return "logistic" if self._n_outputs(fd) == 1 else "multinomial"

    def _set_fitted(self, fn: GLMBlockLoss, result: SolverResult, fd: FitData) -> None:
        super()._set_fitted(fn, result, fd)
        assert fd.classes is not None
        self.classes_: np.ndarray = fd.classes
        self.coef_ = self._coef.copy()
        self.intercept_ = self._intercept.copy()

    def fit(self, X: Any, y: Any) -> LogisticRegression:
        """Fit on X (dask array, dask DataFrame or array-like) and class labels y."""
        return self._fit(X, y)  # type: ignore[no-any-return]

    def decision_function(self, X: Any) -> Any:
        """Signed distance to the boundary: ``(n,)`` for two classes, ``(n, n_classes)`` else."""
        z = self._linear(X)
        return z[:, 0] if self._coef.shape[0] == 1 else z

    def predict_proba(self, X: Any) -> Any:
        """Class probabilities, ``(n, n_classes)``; a dask array chunk-aligned with dask X."""
        z = self._linear(X)
        if is_dask(z):
            return z.map_blocks(_probabilities, dtype=np.float64,
                                chunks=(z.chunks[0], (len(self.classes_),)))
        return _probabilities(z)

    def predict_log_proba(self, X: Any) -> Any:
        """Logarithm of :meth:`predict_proba`."""
        proba = self.predict_proba(X)
        return da.log(proba) if is_dask(proba) else np.log(proba)

    def predict(self, X: Any) -> Any:
        """The most probable class of each row; a dask array chunk-aligned with dask X."""
        z = self._linear(X)
        if is_dask(z):
            return z.map_blocks(_labels, self.classes_, drop_axis=1, dtype=self.classes_.dtype)
        return _labels(z, self.classes_)

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """Accuracy; computed on the cluster for dask input."""
        if is_dask(X) and sample_weight is None:
            y_d = y.to_dask_array() if hasattr(y, "to_dask_array") else da.asarray(y)
            return float((self.predict(X) == y_d).mean().compute())
        return float(super().score(X, y, sample_weight))


def _probabilities(z: np.ndarray) -> np.ndarray:
    if z.shape[1] == 1:
        from scipy.special import expit

        p = expit(z[:, 0])
        return np.column_stack([1.0 - p, p])
    from scipy.special import softmax

    return np.asarray(softmax(z, axis=1))


def _labels(z: np.ndarray, classes: np.ndarray) -> np.ndarray:
    index = (z[:, 0] > 0).astype(int) if z.shape[1] == 1 else z.argmax(axis=1)
    return classes[index]


__all__ = ["LogisticRegression"]
