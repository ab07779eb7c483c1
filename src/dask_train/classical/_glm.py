"""Generalised linear models fitted on a Dask cluster by full-batch solvers, in scikit-learn style:
the machinery every one shares (:class:`_GLM`: hyper-parameter checks, fit, the linear predictor).
The estimators are in :mod:`._glm_logistic` (LogisticRegression) and :mod:`._glm_regression`
(LinearRegression, PoissonRegression).

``fit`` persists the data on the workers once, then each solver iteration is one pass over the
persisted blocks (:func:`~dask_train.classical.full_batch.evaluate_sum`): the parameters go to
the cluster once, one task per group of co-located blocks returns loss/gradient (/Hessian) sums,
those are added up on the workers and the client receives one result. The objectives follow
scikit-learn's, so the coefficients agree with its estimators on the same data.
"""

from __future__ import annotations

import copy
import math
import numbers
import time
from typing import Any

import numpy as np
from distributed import Client
from sklearn.base import BaseEstimator
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

    # -- the client parameter -------------------------------------------------------------------
    # scikit-learn's tools deep-copy parameters (clone, GridSearchCV, check_estimator's
    # deepcopy(get_params())) and hash them with joblib; a Client can be neither deep-copied nor
    # pickled (it holds a running event loop), and it is a connection, not state to copy. So the
    # attribute keeps what was given, ``est.client`` reads the Client itself, and get_params hands
    # out a SharedClient: deep-copying one gives itself, so every copy and clone shares the client.

    @property
    def client(self) -> Any:
        """The client to fit on (None: the current one, else a new embedded cluster)."""
        value = self.__dict__.get("client")
        return value.client if isinstance(value, SharedClient) else value

    @client.setter
    def client(self, value: Any) -> None:
        self.__dict__["client"] = value

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        params = dict(super().get_params(deep=deep))
        value = self.__dict__.get("client")
        # Stored as given, so set_params(**get_params()) round-trips object for object.
        params["client"] = SharedClient(value) if isinstance(value, Client) else value
        return params

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        client = self.client
        memo[id(client)] = client  # shared by the copy, never copied
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

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

    def __getstate__(self) -> dict[str, Any]:
        # A pickled estimator forgets its client; after unpickling it uses the current one.
        state = dict(super().__getstate__())
        state["client"] = None
        return state


class SharedClient:
    """An estimator's client as ``get_params`` reports it: deep-copies to itself, pickles to None.

    Passing one as ``client=`` is passing its client (``est.client`` is the Client itself).
    Pickling forgets the connection, as pickling the estimator does: after unpickling, a fit uses
    the current client. Equal to another SharedClient of the same client, so ``get_params()``
    compares equal call after call.
    """

    __slots__ = ("client",)

    def __init__(self, client: Client) -> None:
        self.client = client

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedClient:
        return self

    def __copy__(self) -> SharedClient:
        return self

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _no_client, ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SharedClient) and other.client is self.client

    def __hash__(self) -> int:
        return id(self.client)

    def __repr__(self) -> str:
        return f"SharedClient({self.client!r})"


def _no_client() -> None:
    return None


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
