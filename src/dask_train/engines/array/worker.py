"""Synchronous data-parallel training of an :class:`~dask_train.models.ArrayModel` with Dask alone.

The numpy counterpart of :mod:`dask_train.engines.torch_sync.rank`: no torch.distributed group, the
gradients are averaged by a Dask tree reduction instead of a collective. Per step:

* each worker's group of co-located blocks (:meth:`dask_train.data.BlockSet.groups`, persisted once) evaluates
  ``loss_grad`` on its next mini-batch, in one task where the blocks live, so no block moves;
* the ``(loss_sum, grad_sum, rows)`` partials are added pairwise on the workers
  (:func:`~dask_train.runtime._reduce.tree_reduce`) and the client receives one result;
* the client (the chief) divides by the rows, which makes the update the exact mean gradient over
  the union of the groups' batches, and applies it with the same torch optimizers as every other
  strategy.

Every group takes the same number of steps per epoch; a group whose rows ran out contributes
nothing, as a rank out of data does in the torch sync strategy, so uneven blocks end an epoch
cleanly. A scorer task evaluates the parameters on the validation data in the background, and the
stop conditions, callbacks and history are those of every other strategy.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from dask_train.models._array import LossGrad, Predict

_ORDERS: OrderedDict[tuple[int, int, int, int, bool], np.ndarray] = OrderedDict()
_ORDERS_LOCK = threading.Lock()


def _order(seed: int, epoch: int, group: int, rows: int, shuffle: bool) -> np.ndarray:
    """A group's row order for one epoch, cached: every step of the epoch reads it."""
    key = (seed, epoch, group, rows, shuffle)
    with _ORDERS_LOCK:
        hit = _ORDERS.get(key)
        if hit is not None:
            return hit
    order = (np.random.default_rng([seed, epoch, group]).permutation(rows) if shuffle
             else np.arange(rows))
    with _ORDERS_LOCK:
        _ORDERS[key] = order
        while len(_ORDERS) > 8:
            _ORDERS.popitem(last=False)
    return order


def _rows(blocks: Sequence[tuple[np.ndarray, np.ndarray]], idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``idx`` of the blocks taken end to end (a gather, block by block)."""
    if len(blocks) == 1:
        return blocks[0][0][idx], blocks[0][1][idx]
    offsets = np.cumsum([0] + [len(b[0]) for b in blocks])
    owner = np.searchsorted(offsets, idx, side="right") - 1
    xs, ys = [], []
    for k, (xb, yb) in enumerate(blocks):
        local = idx[owner == k] - offsets[k]
        if len(local):
            xs.append(xb[local])
            ys.append(yb[local])
    return np.concatenate(xs), np.concatenate(ys)


def group_step(loss_grad: LossGrad, params: np.ndarray, plan: tuple[int, ...],
               *blocks: tuple[np.ndarray, np.ndarray]) -> tuple[float, np.ndarray, int]:
    """Dask task: ``(loss_sum, grad_sum, rows)`` of one group's mini-batch for one step."""
    seed, epoch, step, rows_per_step, group, shuffle = plan
    total = sum(len(b[0]) for b in blocks)
    start = step * rows_per_step
    if start >= total:  # this group's rows ran out before the longest group's
        return 0.0, np.zeros_like(params), 0
    idx = _order(seed, epoch, group, total, bool(shuffle))[start : start + rows_per_step]
    X, y = _rows(blocks, idx)
    loss, grad = loss_grad(params, X, y)
    return float(loss), np.asarray(grad, dtype=np.float64), len(idx)


def score_task(loss_grad: LossGrad, predict: Predict | None, params: np.ndarray,
               validation: tuple[np.ndarray, np.ndarray]) -> dict[str, float]:
    """Dask task: mean loss (and accuracy with ``predict``) of ``params`` on the validation data."""
    X, y = validation
    loss, _ = loss_grad(params, X, y)
    out = {"loss": float(loss) / max(1, len(X))}
    if predict is not None:
        out["accuracy"] = float(np.mean(np.asarray(predict(params, X)) == y))
    return out
