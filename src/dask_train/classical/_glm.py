"""Generalised linear models fitted on a Dask cluster by full-batch solvers, in scikit-learn style.

``fit`` persists the data on the workers once, then each solver iteration is one pass over the
persisted blocks (:func:`~dask_train.classical.full_batch.evaluate_sum`): the parameters go to
the cluster once, one task per group of co-located blocks returns loss/gradient (/Hessian) sums,
those are added up on the workers and the client receives one result. The objectives follow
scikit-learn's, so the coefficients agree with its estimators on the same data.
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Any

import dask.array as da
import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.validation import check_is_fitted, validate_data

from dask_train.classical._glm_input import FitData, is_dask, prepare_fit
from dask_train.classical._glm_losses import GLMBlockLoss, linear_predictor
from dask_train.classical._solvers import (
    MAX_NEWTON_PARAMS,
    SMOOTH_ONLY,
    SOLVERS,
    Problem,
    SolverResult,
    solve,
)
from dask_train.classical.full_batch import evaluate_sum
from dask_train.errors import InvalidInput
from dask_train.runtime import default_client

PENALTIES = ("l2", "l1", "elasticnet", "none")


class _GLM(BaseEstimator):  # type: ignore[misc]
    """Shared fit machinery; subclasses set the family, the task and the penalty scaling."""

    _task = "regression"
    _family = "squared"

    # Set by subclass __init__; declared for mypy.
    penalty: str | None
    l1_ratio: float
    solver: str
    tol: float
    max_iter: int
    fit_intercept: bool
    split_every: int
    client: Any

    # -- hyper-parameters ---------------------------------------------------------------------

    def _strength_problems(self) -> list[str]:
        raise NotImplementedError

    def _penalty_weights(self, n_rows: int) -> tuple[float, float]:
        """``(l2, l1)`` weights of the mean-scaled objective ``mean loss + l2/2 |w|^2 + l1 |w|_1``."""
        raise NotImplementedError

    def _l1_share(self) -> float:
        penalty = "none" if self.penalty is None else self.penalty
        return {"l2": 0.0, "l1": 1.0, "elasticnet": float(self.l1_ratio), "none": 0.0}[penalty]

    def _check_params(self) -> list[str]:
        problems = self._strength_problems()
        penalty = "none" if self.penalty is None else self.penalty
        if penalty not in PENALTIES:
            problems.append(f"penalty={self.penalty!r} is invalid: use one of {PENALTIES} or None.")
        if not _is_real(self.l1_ratio) or not 0.0 <= float(self.l1_ratio) <= 1.0:
            problems.append(f"l1_ratio={self.l1_ratio!r} is invalid: use a number in [0, 1].")
        if self.solver not in SOLVERS:
            problems.append(f"solver={self.solver!r} is invalid: use one of {SOLVERS}.")
        elif self.solver in SMOOTH_ONLY and penalty in ("l1", "elasticnet"):
            problems.append(
                f"solver={self.solver!r} does not support penalty={penalty!r} (the L1 term is not "
                "differentiable): use solver='newton' or 'proximal_grad'."
            )
        if not _is_real(self.tol) or not float(self.tol) > 0:
            problems.append(f"tol={self.tol!r} is invalid: use a number > 0, e.g. 1e-4.")
        if not _is_int(self.max_iter) or self.max_iter < 1:
            problems.append(f"max_iter={self.max_iter!r} is invalid: use an integer >= 1.")
        if not isinstance(self.fit_intercept, (bool, np.bool_)):
            problems.append(f"fit_intercept={self.fit_intercept!r} is invalid: use True or False.")
        if not _is_int(self.split_every) or self.split_every < 2:
            problems.append(f"split_every={self.split_every!r} is invalid: use an integer >= 2.")
        return problems

    # -- fit ----------------------------------------------------------------------------------

    def _fit(self, X: Any, y: Any) -> Any:
        started = time.perf_counter()
        # Bad hyper-parameters are reported together with every problem of X and y that can be
        # seen without a pass over the data; prepare_fit raises them all at once.
        fd = prepare_fit(self, X, y, task=self._task,
                         client=lambda: self.client or default_client(quiet=True),
                         problems=self._check_params())
        try:
            fn = GLMBlockLoss(self._family_for(fd), fd.n_features, self._n_outputs(fd),
                              bool(self.fit_intercept))
            if self.solver == "newton" and fn.n_params > MAX_NEWTON_PARAMS:
                raise InvalidInput([
                    f"solver='newton' with {fn.n_params} parameters would build a "
                    f"{fn.n_params}x{fn.n_params} Hessian per block: use solver='lbfgs' or "
                    f"'proximal_grad' (more than {MAX_NEWTON_PARAMS} parameters)."
                ])
            problem = self._problem(fd, fn)
            problem.started = started
            result = solve(problem, self.solver, tol=float(self.tol), max_iter=int(self.max_iter))
        finally:
            fd.data.release()
        self._set_fitted(fn, result, fd)
        return self

    def _n_outputs(self, fd: FitData) -> int:
        return 1

    def _family_for(self, fd: FitData) -> str:
        return self._family

    def _problem(self, fd: FitData, fn: GLMBlockLoss) -> Problem:
        n = fd.n_rows
        l2, l1 = self._penalty_weights(n)
        grid = np.zeros((fd.n_features + int(fn.fit_intercept), fn.n_outputs), bool)
        grid[: fd.n_features] = True  # the intercept is never penalised, as in scikit-learn
        mask = grid.ravel()
        data, split_every = fd.data, int(self.split_every)

        def evaluate(theta: np.ndarray, order: int) -> tuple[Any, ...]:
            block_fn = GLMBlockLoss(fn.family, fn.n_features, fn.n_outputs, fn.fit_intercept, order)
            terms = evaluate_sum(block_fn, theta, data, split_every=split_every)
            w = np.where(mask, theta, 0.0)
            f = terms[0] / n + 0.5 * l2 * float(w @ w)
            g = terms[1] / n + l2 * w
            if order == 1:
                return f, g
            H = terms[2] / n
            H[np.diag_indices_from(H)] += l2 * mask
            return f, g, H

        theta0 = np.zeros(fn.n_params)
        if fn.fit_intercept and fn.family == "poisson" and fd.y_mean > 0:
            theta0[-1] = math.log(fd.y_mean)  # start at the best constant model, as scikit-learn
        return Problem(evaluate, theta0, l1=l1, l1_mask=mask)

    def _set_fitted(self, fn: GLMBlockLoss, result: SolverResult, fd: FitData) -> None:
        coef, intercept = fn.unpack(result.theta)
        self._coef = coef.T.copy()  # (n_outputs, n_features), as linear_predictor wants it
        self._intercept = intercept.copy()
        self.n_iter_ = int(result.n_iter)
        self.loss_history_ = list(result.loss_history)
        self.time_history_ = list(result.time_history)
        self.converged_ = bool(result.converged)

    # -- predict ------------------------------------------------------------------------------

    def _linear(self, X: Any) -> Any:
        """The linear predictor ``(n, n_outputs)``: a dask array chunk-aligned with dask X."""
        check_is_fitted(self, "n_iter_")
        coef, intercept = self._coef, self._intercept
        if is_dask(X):
            Xd = X.to_dask_array() if hasattr(X, "to_dask_array") else X
            if Xd.ndim != 2 or Xd.shape[1] != self.n_features_in_:
                raise InvalidInput([
                    f"X has shape {Xd.shape}, but {type(self).__name__} is expecting "
                    f"{self.n_features_in_} features as input: pass the columns used in fit."
                ])
            if Xd.numblocks[1] > 1:
                Xd = Xd.rechunk({1: -1})  # rows stay as they are: the result aligns with X
            return Xd.map_blocks(linear_predictor, coef, intercept, dtype=np.float64,
                                 chunks=(Xd.chunks[0], (coef.shape[0],)))
        Xa = validate_data(self, X, reset=False, dtype=[np.float64, np.float32])
        return linear_predictor(Xa, coef, intercept)

    def __sklearn_clone__(self) -> Any:
        # A Client cannot be deep-copied (it holds a running event loop): the clone shares it,
        # as it is a connection, not state of the estimator.
        params = self.get_params(deep=False)
        client = params.pop("client", None)
        new = type(self)(**{k: _copy_param(v) for k, v in params.items()})
        new.client = client
        return new

    def __getstate__(self) -> dict[str, Any]:
        # A pickled estimator forgets its client; after unpickling it uses the current one.
        state = dict(super().__getstate__())
        state["client"] = None
        return state


def _copy_param(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _r2(y_true: da.Array, y_pred: da.Array) -> float:
    resid = ((y_true - y_pred) ** 2).sum()
    total = ((y_true - y_true.mean()) ** 2).sum()
    r, t = da.compute(resid, total)
    return 1.0 - float(r) / float(t) if t > 0 else (1.0 if r == 0 else 0.0)


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


__all__ = ["LinearRegression", "LogisticRegression", "PoissonRegression"]
