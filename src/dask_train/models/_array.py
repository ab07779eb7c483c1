"""Models written with numpy: a parameter vector and functions of it, for ``strategy="sync"``.

A torch module is trained over a torch.distributed group; an :class:`ArrayModel` needs no
framework at all. Each step, every worker evaluates ``loss_grad`` on its own mini-batch of the
blocks it holds, and the sums are combined on the workers by a Dask tree reduction
(:mod:`dask_train.engines.array.worker`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

#: ``loss_grad(params, X, y) -> (loss_sum, grad_sum)``, both summed over the rows of ``X``.
LossGrad = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[float, np.ndarray]]
#: ``predict(params, X) -> labels`` (one per row of ``X``).
Predict = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class ArrayModel:
    """A model defined by numpy functions of one flat parameter vector.

    Pass it to ``dt.Trainer(model, strategy="sync")`` in place of a torch module: gradients are
    then averaged with a Dask tree reduction on the workers instead of a torch collective.

    Parameters
    ----------
    params : numpy.ndarray
        Initial parameters, a 1-D float array (copied to float64).
    loss_grad : callable
        ``loss_grad(params, X, y) -> (loss_sum, grad_sum)``: the loss and its gradient *summed*
        over the rows of the batch ``X`` (sums, not means, so batches of any size combine
        exactly). It runs on the workers, so it must be picklable (a module-level function or a
        ``functools.partial`` of one).
    predict : callable, optional
        ``predict(params, X) -> labels``; with it the scorer reports an accuracy beside the loss.

    Examples
    --------
    >>> model = softmax_regression(n_features=64, n_classes=10)
    >>> model.params.shape
    (650,)
    """

    params: np.ndarray
    loss_grad: LossGrad
    predict: Predict | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", np.array(self.params, dtype=np.float64))

    def problems(self) -> list[str]:
        """What is wrong with this model, as messages that name the field and the fix."""
        out = []
        if self.params.ndim != 1 or self.params.size == 0:
            out.append(f"ArrayModel.params has shape {self.params.shape}: pass a non-empty 1-D "
                       "array (flatten your parameters into one vector).")
        elif not np.isfinite(self.params).all():
            out.append("ArrayModel.params holds NaN or inf: start from finite values.")
        if not callable(self.loss_grad):
            out.append(f"ArrayModel.loss_grad={self.loss_grad!r} is not callable: pass a function "
                       "loss_grad(params, X, y) -> (loss_sum, grad_sum).")
        if self.predict is not None and not callable(self.predict):
            out.append(f"ArrayModel.predict={self.predict!r} is not callable: pass a function "
                       "predict(params, X) -> labels, or None.")
        return out

    def check_on(self, n_features: int, y_dtype: Any) -> list[str]:
        """Call ``loss_grad`` on two zero rows shaped like the data; report what does not fit."""
        X = np.zeros((2, n_features))
        y = np.zeros(2, dtype=y_dtype)
        try:
            loss, grad = self.loss_grad(self.params, X, y)
        except Exception as exc:  # the user's function not fitting the data
            return [f"ArrayModel.loss_grad failed on 2 rows shaped like X (2, {n_features}): "
                    f"{type(exc).__name__}: {exc}. Check it against the data's shape."]
        grad = np.asarray(grad)
        if grad.shape != self.params.shape:
            return [f"ArrayModel.loss_grad returned a gradient of shape {grad.shape} for params "
                    f"of shape {self.params.shape}: return one value per parameter."]
        if np.ndim(loss) != 0:
            return [f"ArrayModel.loss_grad returned a loss of shape {np.shape(loss)}: return the "
                    "loss summed over the batch, one number."]
        return []


def _softmax_loss_grad(
    params: np.ndarray, X: np.ndarray, y: np.ndarray, *, n_classes: int, l2: float
) -> tuple[float, np.ndarray]:
    n_features = X.shape[1]
    W = params[: n_features * n_classes].reshape(n_features, n_classes)
    b = params[n_features * n_classes :]
    z = X @ W + b
    z -= z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    labels = y.astype(np.int64)
    rows = np.arange(len(X))
    loss = -log_p[rows, labels].sum()
    delta = np.exp(log_p)
    delta[rows, labels] -= 1.0
    grad = np.concatenate([(X.T @ delta).ravel(), delta.sum(axis=0)])
    if l2:
        # A per-row penalty, so the batch sums stay a sum over rows: mean loss + l2/2 |W|^2.
        loss += 0.5 * l2 * len(X) * float(W.ravel() @ W.ravel())
        grad[: n_features * n_classes] += l2 * len(X) * W.ravel()
    return float(loss), grad


def _softmax_predict(params: np.ndarray, X: np.ndarray, *, n_classes: int) -> np.ndarray:
    n_features = X.shape[1]
    W = params[: n_features * n_classes].reshape(n_features, n_classes)
    return np.asarray((X @ W + params[n_features * n_classes :]).argmax(axis=1))


def softmax_regression(n_features: int, n_classes: int, *, l2: float = 0.0) -> ArrayModel:
    """Multinomial logistic regression as an :class:`ArrayModel`, starting from zeros.

    Parameters
    ----------
    n_features, n_classes : int
    l2 : float
        Ridge penalty on the weights (not the intercepts), per row.

    Examples
    --------
    >>> model = softmax_regression(4, 3)
    >>> loss, grad = model.loss_grad(model.params, np.ones((5, 4)), np.array([0, 1, 2, 0, 1]))
    >>> round(loss / 5, 4), grad.shape                    # log(3) per row at zero weights
    (1.0986, (15,))
    """
    return ArrayModel(
        params=np.zeros(n_features * n_classes + n_classes),
        loss_grad=functools.partial(_softmax_loss_grad, n_classes=n_classes, l2=float(l2)),
        predict=functools.partial(_softmax_predict, n_classes=n_classes),
    )
