"""Solvers for ``minimise f(theta) + l1 * ||theta[mask]||_1`` with a distributed smooth part ``f``.

Each solver only sees :class:`Problem`: ``evaluate(theta, order)`` returns ``(f, grad)`` or, with
``order=2``, ``(f, grad, hessian)``; the models build it from :func:`distributed_loss_grad` (one
pass over the persisted blocks per call) plus the local L2 penalty. Every evaluation is a full pass
over the data, so the solvers reuse the values a line search already computed at the accepted
point instead of evaluating there again.

Convergence is measured the same way for all of them: the largest entry of the minimum-norm
subgradient (:func:`optimality`), i.e. ``max |grad|`` without an L1 term.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.linalg
import scipy.optimize
from sklearn.exceptions import ConvergenceWarning

SOLVERS = ("lbfgs", "newton", "gradient_descent", "proximal_grad")
SMOOTH_ONLY = ("lbfgs", "gradient_descent")
MAX_NEWTON_PARAMS = 4096  # the Hessian of each block is n_params**2 floats (128 MiB at 4096)

_ARMIJO = 1e-4  # sufficient decrease constant of the backtracking line searches
_MAX_BACKTRACKS = 60


@dataclass
class Problem:
    """The objective: smooth part from ``evaluate`` plus ``l1 * sum |theta[l1_mask]|``."""

    evaluate: Callable[[np.ndarray, int], tuple[Any, ...]]
    theta0: np.ndarray
    l1: float = 0.0
    l1_mask: np.ndarray | None = None
    started: float | None = None  # time.perf_counter() that time_history counts from

    def penalty(self, theta: np.ndarray) -> float:
        if self.l1 == 0.0:
            return 0.0
        return self.l1 * float(np.abs(theta[self._mask]).sum())

    @property
    def _mask(self) -> np.ndarray:
        return np.ones(self.theta0.shape, bool) if self.l1_mask is None else self.l1_mask

    def weights(self) -> np.ndarray:
        """Per-coordinate L1 weight (0 where the coordinate is not penalised)."""
        return np.where(self._mask, self.l1, 0.0)


@dataclass
class SolverResult:
    """What a solver returns: parameters, iterations, objective and seconds after each iteration."""

    theta: np.ndarray
    n_iter: int
    converged: bool
    loss_history: list[float] = field(default_factory=list)
    time_history: list[float] = field(default_factory=list)


def optimality(theta: np.ndarray, grad: np.ndarray, weights: np.ndarray) -> float:
    """Largest entry of the minimum-norm subgradient of ``f + sum(weights * |theta|)``."""
    sub = np.where(
        theta != 0,
        grad + weights * np.sign(theta),
        np.maximum(np.abs(grad) - weights, 0.0),
    )
    return float(np.max(np.abs(sub), initial=0.0))


def _flat(F: float, F_new: float) -> bool:
    """Whether ``F_new`` is within rounding of ``F``: a sum over millions of rows is exact to about
    1e-13 relative, so below that the objective cannot rank two points and the line searches fall
    back to the gradient, which stays accurate."""
    return bool(np.isfinite(F_new)) and F_new <= F + 1e-12 * (1.0 + abs(F))


def soft_threshold(v: np.ndarray, t: np.ndarray) -> np.ndarray:
    """The proximal operator of ``sum(t * |v|)``."""
    return np.sign(v) * np.maximum(np.abs(v) - t, 0.0)


class _Recorder:
    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        # Times count from the problem's start (e.g. the beginning of fit), else from now.
        self.started = problem.started if problem.started is not None else time.perf_counter()
        self.losses: list[float] = []
        self.times: list[float] = []

    def record(self, objective: float) -> None:
        self.losses.append(float(objective))
        self.times.append(time.perf_counter() - self.started)

    def result(self, theta: np.ndarray, converged: bool, why: str = "max_iter") -> SolverResult:
        if not converged:
            what = {
                "max_iter": "reached max_iter; raise max_iter, loosen tol, or scale the features",
                "line_search": "found no decrease along its direction (the objective is flat at "
                "machine precision or not finite nearby); loosen tol or scale the features",
            }[why]
            warnings.warn(
                f"the solver stopped after {len(self.losses)} iterations without reaching tol: it "
                f"{what}.",
                ConvergenceWarning,
                stacklevel=4,
            )
        return SolverResult(theta, len(self.losses), converged, self.losses, self.times)


def solve(problem: Problem, solver: str, *, tol: float, max_iter: int) -> SolverResult:
    """Run ``solver`` (one of :data:`SOLVERS`) on ``problem``."""
    if solver == "lbfgs":
        return lbfgs(problem, tol=tol, max_iter=max_iter)
    if solver == "newton":
        return newton(problem, tol=tol, max_iter=max_iter)
    if solver == "gradient_descent":
        return gradient_descent(problem, tol=tol, max_iter=max_iter)
    if solver == "proximal_grad":
        return proximal_grad(problem, tol=tol, max_iter=max_iter)
    raise ValueError(f"solver={solver!r} is unknown: use one of {SOLVERS}.")


def lbfgs(problem: Problem, *, tol: float, max_iter: int) -> SolverResult:
    """scipy's L-BFGS-B, each function and gradient value one distributed pass (smooth only)."""
    rec = _Recorder(problem)
    last: dict[str, float] = {}

    def fun(theta: np.ndarray) -> tuple[float, np.ndarray]:
        f, g = problem.evaluate(theta, 1)[:2]
        last["f"], last["opt"] = f, float(np.max(np.abs(g), initial=0.0))
        return f, g

    def callback(intermediate_result: scipy.optimize.OptimizeResult) -> None:
        rec.record(float(intermediate_result.fun))

    # ftol as in scikit-learn's lbfgs path: stop on the gradient, not on a tiny relative decrease.
    res = scipy.optimize.minimize(
        fun, problem.theta0, jac=True, method="L-BFGS-B", callback=callback,
        options={"maxiter": max_iter, "maxls": 50, "gtol": tol, "ftol": 64 * np.finfo(float).eps},
    )
    # status 2 is a line search that found no decrease: at the optimum in floating point when the
    # gradient there is below tol, otherwise a real failure to report.
    converged = res.status == 0 or last.get("opt", np.inf) <= tol
    return rec.result(np.asarray(res.x), converged, "max_iter" if res.status == 1 else "line_search")


def gradient_descent(problem: Problem, *, tol: float, max_iter: int) -> SolverResult:
    """Steepest descent with a backtracking (Armijo) line search whose first trial step adapts.

    Each iteration first tries 1.25x the last accepted step: usually accepted (one pass), and when
    not, halving costs a pass or two, so the step tracks the local curvature at about 1.3 passes per
    iteration.
    """
    rec = _Recorder(problem)
    theta = problem.theta0.copy()
    f, g = problem.evaluate(theta, 1)[:2]
    step = 1.0 / max(1.0, float(np.linalg.norm(g)))
    for _ in range(max_iter):
        if float(np.max(np.abs(g), initial=0.0)) <= tol:
            return rec.result(theta, True)
        step *= 1.25
        slope = float(g @ g)
        for _ in range(_MAX_BACKTRACKS):
            trial = theta - step * g
            f_new, g_new = problem.evaluate(trial, 1)[:2]
            if np.isfinite(f_new) and f_new <= f - _ARMIJO * step * slope:
                break
            # Below rounding, accept a step no longer than 1 / (local Lipschitz constant of the
            # gradient), which cannot make a convex objective worse (see _flat).
            if _flat(f, f_new) and float(np.linalg.norm(g_new - g)) <= float(np.sqrt(slope)):
                break
            step *= 0.5
        else:
            return rec.result(theta, False, "line_search")
        theta, f, g = trial, f_new, g_new
        rec.record(f)
    return rec.result(theta, float(np.max(np.abs(g), initial=0.0)) <= tol)


def _solve_newton_system(H: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``H^-1 g``; a least-squares solution where H is singular (collinear features, no penalty)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", scipy.linalg.LinAlgWarning)
            return np.asarray(scipy.linalg.solve(H, g, assume_a="pos"))
    except (np.linalg.LinAlgError, scipy.linalg.LinAlgError, scipy.linalg.LinAlgWarning, ValueError):
        return np.asarray(scipy.linalg.lstsq(H, g, cond=1e-12)[0])


def _l1_newton_direction(
    theta: np.ndarray, g: np.ndarray, H: np.ndarray, weights: np.ndarray, *, tol: float
) -> np.ndarray:
    """Minimise ``g.d + d.H.d/2 + sum(w |theta + d|)`` by cyclic coordinate descent (on the client).

    The quadratic model needs no data: n_params**2 work per sweep, tiny next to a pass over the
    blocks. This is the proximal Newton step of glmnet and of scikit-learn's newton-cd.
    """
    x = theta.copy()
    diag = np.maximum(np.diag(H), 1e-12)
    grad_q = g.copy()  # gradient of the quadratic model at x: g + H (x - theta)
    for _ in range(1000):
        biggest = 0.0
        for j in range(len(x)):
            old = x[j]
            z = old - grad_q[j] / diag[j]
            new = float(np.sign(z) * max(abs(z) - weights[j] / diag[j], 0.0))
            if new != old:
                grad_q += H[:, j] * (new - old)
                x[j] = new
                biggest = max(biggest, abs(new - old))
        if biggest <= tol * 1e-3:
            break
    return x - theta


def newton(problem: Problem, *, tol: float, max_iter: int) -> SolverResult:
    """Newton's method with the distributed Hessian and a backtracking line search.

    With an L1 term each direction comes from the quadratic model plus the L1 term (proximal
    Newton), solved locally by coordinate descent.
    """
    rec = _Recorder(problem)
    w = problem.weights()
    theta = problem.theta0.copy()
    f, g, H = problem.evaluate(theta, 2)
    F = f + problem.penalty(theta)
    for _ in range(max_iter):
        if optimality(theta, g, w) <= tol:
            return rec.result(theta, True)
        if problem.l1 > 0:
            d = _l1_newton_direction(theta, g, H, w, tol=tol)
            decrease = float(g @ d) + problem.penalty(theta + d) - problem.penalty(theta)
        else:
            d = -_solve_newton_system(H, g)
            decrease = float(g @ d)
        if decrease >= 0:  # no descent direction left in floating point
            return rec.result(theta, False, "line_search")
        step, opt = 1.0, optimality(theta, g, w)
        for _ in range(_MAX_BACKTRACKS):
            trial = theta + step * d
            f_new, g_new, H_new = problem.evaluate(trial, 2)
            F_new = f_new + problem.penalty(trial)
            if np.isfinite(F_new) and F_new <= F + _ARMIJO * step * decrease:
                break
            if _flat(F, F_new) and optimality(trial, g_new, w) < opt:
                break  # no visible decrease, but closer to stationary: accept (see _flat)
            step *= 0.5
        else:
            return rec.result(theta, False, "line_search")
        theta, f, g, H, F = trial, f_new, g_new, H_new, F_new
        rec.record(F)
    return rec.result(theta, optimality(theta, g, w) <= tol)


def proximal_grad(problem: Problem, *, tol: float, max_iter: int) -> SolverResult:
    """Accelerated proximal gradient (FISTA) with backtracking and adaptive restart.

    Each iteration evaluates the objective and gradient at the candidate (one pass; the gradient
    gives the stopping test) and the gradient at the next extrapolated point (a second pass, saved
    when there is no momentum). The momentum is dropped whenever it points against the last step
    (the gradient restart of O'Donoghue & Candes), which gives linear convergence on strongly
    convex problems and needs no objective values, so it keeps working at rounding level.
    """
    rec = _Recorder(problem)
    w = problem.weights()
    x = problem.theta0.copy()
    fx, gx = problem.evaluate(x, 1)[:2]
    step = 1.0 / max(1.0, float(np.linalg.norm(gx)))
    y, fy, gy, t = x, fx, gx, 1.0
    for _ in range(max_iter):
        if optimality(x, gx, w) <= tol:
            return rec.result(x, True)
        step *= 1.5  # let the step grow again after a cautious stretch
        for _ in range(_MAX_BACKTRACKS):
            cand = soft_threshold(y - step * gy, step * w)
            fc, gc = problem.evaluate(cand, 1)[:2]
            diff = cand - y
            if np.isfinite(fc) and fc <= fy + float(gy @ diff) + float(diff @ diff) / (2 * step):
                break
            # Below rounding, test the same bound through the gradient's Lipschitz constant.
            if _flat(fy, fc) and float(np.linalg.norm(gc - gy)) * step <= float(np.linalg.norm(diff)):
                break
            step *= 0.5
        else:
            return rec.result(x, False, "line_search")
        if float((y - cand) @ (cand - x)) > 0:
            t_next, y = 1.0, cand  # restart: the momentum pointed uphill
        else:
            t_next = (1 + np.sqrt(1 + 4 * t * t)) / 2
            y = cand + ((t - 1) / t_next) * (cand - x)
        x, fx, gx, t = cand, fc, gc, t_next
        rec.record(fx + problem.penalty(x))
        if y is x or np.array_equal(y, x):
            fy, gy = fx, gx
        else:
            fy, gy = problem.evaluate(y, 1)[:2]
    return rec.result(x, optimality(x, gx, w) <= tol)


__all__ = [
    "MAX_NEWTON_PARAMS",
    "SMOOTH_ONLY",
    "SOLVERS",
    "Problem",
    "SolverResult",
    "gradient_descent",
    "lbfgs",
    "newton",
    "optimality",
    "proximal_grad",
    "soft_threshold",
    "solve",
]
