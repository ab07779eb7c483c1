"""Linear and Poisson regression on a Dask cluster, on the shared GLM machinery."""

from __future__ import annotations

import numbers
from typing import Any

import dask.array as da
import numpy as np
from sklearn.base import RegressorMixin

from dask_train.classical._glm import _GLM
from dask_train.classical._glm_input import FitData, is_dask
from dask_train.classical._glm_losses import GLMBlockLoss
from dask_train.classical._solvers import SolverResult


class _Regressor(RegressorMixin, _GLM):
    """Predict and score of the single-output regressors."""

    def _strength_problems(self) -> list[str]:
        alpha = getattr(self, "alpha", None)
        if not isinstance(alpha, numbers.Real) or isinstance(alpha, bool) or not float(alpha) >= 0:
            return [f"alpha={alpha!r} is invalid: use a number >= 0 (0 means no penalty)."]
        return []

    def _penalty_weights(self, n_rows: int) -> tuple[float, float]:
        if self.penalty in (None, "none"):
            return 0.0, 0.0
        alpha, share = float(getattr(self, "alpha", 0.0)), self._l1_share()
        return (1.0 - share) * alpha, share * alpha

    def _set_fitted(self, fn: GLMBlockLoss, result: SolverResult, fd: FitData) -> None:
        super()._set_fitted(fn, result, fd)
        self.coef_ = self._coef[0].copy()
        self.intercept_ = float(self._intercept[0])

    def fit(self, X: Any, y: Any) -> Any:
        """Fit on X (dask array, dask DataFrame or array-like) and targets y."""
        return self._fit(X, y)

    def _inverse_link(self, z: Any) -> Any:
        return z

    def predict(self, X: Any) -> Any:
        """Predicted targets; a dask array chunk-aligned with dask X."""
        return self._inverse_link(self._linear(X)[:, 0])

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """R^2; computed on the cluster for dask input."""
        if is_dask(X) and sample_weight is None:
            y_d = y.to_dask_array() if hasattr(y, "to_dask_array") else da.asarray(y)
            return _r2(y_d.astype(np.float64), self.predict(X))
        return float(super().score(X, y, sample_weight))


class LinearRegression(_Regressor):
    """Least-squares linear regression on a Dask cluster, optionally penalised as scikit-learn's ElasticNet.

    Minimises ``sum_i (y_i - x_i w - b)^2 / (2 n) + alpha * penalty(w)`` with ``penalty`` as
    scikit-learn's :class:`~sklearn.linear_model.ElasticNet`: ``|w|^2 / 2`` (l2: scikit-learn's
    ``Ridge(alpha=alpha * n)``), ``|w|_1`` (l1: ``Lasso(alpha)``), their ``l1_ratio`` mix
    (elasticnet) or nothing (none, the default: ordinary least squares).

    Parameters
    ----------
    penalty : {"none", "l2", "l1", "elasticnet"} or None
    alpha : float
        Penalty strength, >= 0 (ignored with penalty "none").
    l1_ratio : float
    solver : {"newton", "lbfgs", "gradient_descent", "proximal_grad"}
        The default ``newton`` solves the normal equations built on the workers in one step.
    tol, max_iter, fit_intercept, split_every, client
        As in :class:`LogisticRegression`.

    Examples
    --------
    >>> reg = dt.LinearRegression(client=client).fit(X, y)      # doctest: +SKIP
    >>> reg.coef_, reg.intercept_                               # doctest: +SKIP
    """

    def __init__(
        self,
        penalty: str | None = "none",
        *,
        alpha: float = 1.0,
        l1_ratio: float = 0.5,
        solver: str = "newton",
        tol: float = 1e-6,
        max_iter: int = 100,
        fit_intercept: bool = True,
        split_every: int = 2,
        client: Any = None,
    ) -> None:
        self.penalty = penalty
        self.alpha = alpha
        self.l1_ratio = l1_ratio
        self.solver = solver
        self.tol = tol
        self.max_iter = max_iter
        self.fit_intercept = fit_intercept
        self.split_every = split_every
        self.client = client


class PoissonRegression(_Regressor):
    """Poisson regression (log link) on a Dask cluster, with scikit-learn's PoissonRegressor objective.

    Minimises ``sum_i deviance_i / (2 n) + alpha * penalty(w)``; with the defaults (l2,
    ``alpha=1``) that is :class:`sklearn.linear_model.PoissonRegressor`'s objective.

    Parameters
    ----------
    penalty : {"l2", "l1", "elasticnet", "none"} or None
    alpha : float
    l1_ratio : float
    solver : {"lbfgs", "newton", "gradient_descent", "proximal_grad"}
    tol, max_iter, fit_intercept, split_every, client
        As in :class:`LogisticRegression`.

    Examples
    --------
    >>> dt.PoissonRegression(alpha=0.1, client=client).fit(X, counts).predict(X)  # doctest: +SKIP
    """

    _task = "count"
    _family = "poisson"

    def __init__(
        self,
        penalty: str | None = "l2",
        *,
        alpha: float = 1.0,
        l1_ratio: float = 0.5,
        solver: str = "lbfgs",
        tol: float = 1e-4,
        max_iter: int = 100,
        fit_intercept: bool = True,
        split_every: int = 2,
        client: Any = None,
    ) -> None:
        self.penalty = penalty
        self.alpha = alpha
        self.l1_ratio = l1_ratio
        self.solver = solver
        self.tol = tol
        self.max_iter = max_iter
        self.fit_intercept = fit_intercept
        self.split_every = split_every
        self.client = client

    def _inverse_link(self, z: Any) -> Any:
        return da.exp(z) if is_dask(z) else np.exp(z)

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.target_tags.positive_only = True
        return tags



def _r2(y_true: da.Array, y_pred: da.Array) -> float:
    resid = ((y_true - y_pred) ** 2).sum()
    total = ((y_true - y_true.mean()) ** 2).sum()
    r, t = da.compute(resid, total)
    return 1.0 - float(r) / float(t) if t > 0 else (1.0 if r == 0 else 0.0)


__all__ = ["LinearRegression", "PoissonRegression"]
