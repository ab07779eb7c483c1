"""Per-block loss, gradient and Hessian sums of generalised linear models (run on the workers).

The parameters are one flat vector, the C-order ravel of a ``(n_features + fit_intercept,
n_outputs)`` matrix whose last row is the intercept: one column for binary logistic, linear and
Poisson regression, one per class for multinomial logistic regression. The intercept is handled
analytically, so ``X`` is never copied to append a column of ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import expit, logsumexp

FAMILIES = ("logistic", "multinomial", "squared", "poisson")

# Rows per inner chunk: X @ W and X.T @ dZ run on the same rows while they are still in the CPU
# cache (256 Ki floats, 2 MiB), so a block is read from memory once per evaluation instead of twice.
_CHUNK_VALUES = 2**18


@dataclass(frozen=True)
class GLMBlockLoss:
    """``fn(params, X_block, y_block)`` for :func:`~dask_train.distributed_loss_grad`.

    Returns ``(loss_sum, grad_sum)``, or ``(loss_sum, grad_sum, hessian_sum)`` with ``order=2``,
    summed over the rows of the block; the caller divides by the number of rows and adds the
    penalty.

    Parameters
    ----------
    family : str
        ``"logistic"`` (y in {0, 1}), ``"multinomial"`` (y the class index), ``"squared"``
        (half squared error) or ``"poisson"`` (log link; Poisson deviance / 2 up to a constant).
    n_features : int
    n_outputs : int
        Columns of the coefficient matrix: the number of classes for multinomial, else 1.
    fit_intercept : bool
    order : int
        1 for loss and gradient, 2 to add the Hessian.

    Examples
    --------
    >>> fn = GLMBlockLoss("squared", n_features=2, n_outputs=1, fit_intercept=False)
    >>> loss, grad = fn(np.array([1.0, 0.0]), np.eye(2), np.array([1.0, 1.0]))
    >>> float(loss), grad.tolist()
    (0.5, [0.0, -1.0])
    """

    family: str
    n_features: int
    n_outputs: int = 1
    fit_intercept: bool = True
    order: int = 1

    @property
    def n_params(self) -> int:
        """Length of the flat parameter vector."""
        return (self.n_features + int(self.fit_intercept)) * self.n_outputs

    def unpack(self, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(coef (n_features, n_outputs), intercept (n_outputs,))`` from the flat vector."""
        W = np.asarray(params, dtype=np.float64).reshape(-1, self.n_outputs)
        b = W[self.n_features] if self.fit_intercept else np.zeros(self.n_outputs)
        return W[: self.n_features], b

    def __call__(
        self, params: np.ndarray, X: np.ndarray, y: np.ndarray
    ) -> tuple[float, np.ndarray] | tuple[float, np.ndarray, np.ndarray]:
        coef, intercept = self.unpack(params)
        p, k = self.n_features, self.n_outputs
        rows_out = p + int(self.fit_intercept)
        grad = np.zeros((rows_out, k))
        hess = np.zeros((rows_out, k, rows_out, k)) if self.order >= 2 else None
        loss = 0.0
        step = max(64, _CHUNK_VALUES // max(1, p))
        for start in range(0, X.shape[0], step):
            Xc, yc = X[start : start + step], y[start : start + step]
            Z = Xc @ coef
            Z += intercept
            part, dZ, curv = _pointwise(self.family, Z, yc, want_curvature=hess is not None)
            loss += part
            grad[:p] += Xc.T @ dZ
            if self.fit_intercept:
                grad[p] += dZ.sum(axis=0)
            if hess is not None:
                _add_hessian(hess, Xc, curv, fit_intercept=self.fit_intercept)
        if hess is None:
            return loss, grad.ravel()
        n = rows_out * k
        return loss, grad.ravel(), hess.reshape(n, n)


def _pointwise(
    family: str, Z: np.ndarray, y: np.ndarray, *, want_curvature: bool
) -> tuple[float, np.ndarray, np.ndarray | None]:
    """Loss sum, d loss / dZ and (optionally) the curvature for the linear predictors ``Z (m, k)``.

    The curvature is ``(m,)`` for one output (d2 loss / dz2) and ``(m, k, k)`` for multinomial.
    """
    if family == "multinomial":
        lse = logsumexp(Z, axis=1)
        rows = np.arange(Z.shape[0])
        labels = y.astype(np.intp)
        loss = float(lse.sum() - Z[rows, labels].sum())
        P = np.exp(Z - lse[:, None])
        dZ = P.copy()
        dZ[rows, labels] -= 1.0
        curv = None
        if want_curvature:
            curv = -P[:, :, None] * P[:, None, :]
            curv[:, np.arange(Z.shape[1]), np.arange(Z.shape[1])] += P
        return loss, dZ, curv
    z = Z[:, 0]
    if family == "logistic":
        # log(1 + e^z) - y z, stable for large |z|
        loss = float(np.logaddexp(0.0, z).sum() - y @ z)
        prob = expit(z)
        return loss, (prob - y)[:, None], (prob * (1.0 - prob) if want_curvature else None)
    if family == "squared":
        r = z - y
        return 0.5 * float(r @ r), r[:, None], (np.ones_like(z) if want_curvature else None)
    if family == "poisson":
        with np.errstate(over="ignore"):  # an overflow is an inf loss the line search rejects
            mu = np.exp(z)
        loss = float(mu.sum() - y @ z)
        return loss, (mu - y)[:, None], (mu if want_curvature else None)
    raise ValueError(f"family={family!r} is unknown: use one of {FAMILIES}.")


def _add_hessian(hess: np.ndarray, Xc: np.ndarray, curv: np.ndarray | None, *, fit_intercept: bool) -> None:
    """Add ``sum_i xa_i xa_i^T (x) S_i`` to ``hess (p', k, p', k)``; xa is x with a trailing 1."""
    assert curv is not None
    Xa = np.hstack([Xc, np.ones((Xc.shape[0], 1))]) if fit_intercept else Xc
    if curv.ndim == 1:
        hess[:, 0, :, 0] += Xa.T @ (Xa * curv[:, None])
        return
    k = curv.shape[1]
    for a in range(k):
        for b in range(a, k):
            block = Xa.T @ (Xa * curv[:, a, b][:, None])
            hess[:, a, :, b] += block
            if b != a:
                hess[:, b, :, a] += block


def linear_predictor(X: np.ndarray, coef: np.ndarray, intercept: np.ndarray) -> np.ndarray:
    """``X @ coef.T + intercept`` for ``coef (k, p)``; used block-wise by ``predict``."""
    return np.asarray(X, dtype=np.float64) @ coef.T + intercept


__all__ = ["FAMILIES", "GLMBlockLoss", "linear_predictor"]
