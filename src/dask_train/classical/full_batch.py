"""Full-batch training of classical models: per-block loss/gradient sums, reduced on the workers.

Many models minimise a loss that is a sum over examples, so the loss, the gradient and the Hessian
split into per-block sums. This module computes them the fast way on a Dask cluster:

* the training blocks are persisted once on the workers
  (:func:`~dask_train.data.persist_data`) and reused by every iteration, never re-read from the
  source;
* the parameters go to the cluster once per iteration (:func:`~dask_train.runtime.send_params`:
  tiny ones inside the task messages, larger ones one ``scatter`` straight to one worker, never a
  broadcast; see there for the measurements);
* one task per group of blocks that live on the same worker evaluates the user's function on each of
  its blocks and sums the results, so no block ever moves;
* the partial sums are combined pairwise on the workers (:func:`~dask_train.runtime.tree_reduce`)
  and the client receives one result per call.

The solvers that drive these sums (gradient descent, L-BFGS, Newton, proximal gradient) are in
:mod:`dask_train.classical._solvers`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from distributed import Client

from dask_train.data import BlockSet, persist_data
from dask_train.data._inputs import is_collection
from dask_train.errors import InvalidInput
from dask_train.runtime import add_terms, default_client, send_params, tree_reduce

BlockFn = Callable[..., Any]


# -- the building block ----------------------------------------------------------------------------


def _eval_group(fn: BlockFn, params: Any, *blocks: tuple[np.ndarray, np.ndarray | None]) -> Any:
    """Evaluate ``fn`` on each block of one group (all on this worker) and sum the results."""
    total = None
    for X_block, y_block in blocks:
        if X_block.shape[0] == 0:
            continue
        part = fn(params, X_block, y_block)
        total = part if total is None else add_terms(total, part)
    if total is None:  # every block of the group was empty: evaluate on an empty slice for zeros
        X_block, y_block = blocks[0]
        total = fn(params, X_block, y_block)
    return total


def evaluate_sum(
    fn: BlockFn, params: Any, data: BlockSet, *, split_every: int = 2, param_future: Any = None
) -> Any:
    """``sum over blocks of fn(params, X_block, y_block)``, reduced on the workers; one result back.

    In-memory input (scattered, which Dask cannot recompute) lost with a worker is sent again
    from the client first, and an evaluation that failed because a worker died meanwhile is
    done once more on the data sent again.
    """
    if data.source is not None:
        data.resend_lost()
    try:
        return _evaluate_sum(fn, params, data, split_every=split_every, param_future=param_future)
    except Exception:
        if data.source is None or not data.resend_lost():
            raise
    alive = param_future is not None and param_future.status == "finished"
    return _evaluate_sum(fn, params, data, split_every=split_every,
                         param_future=param_future if alive else None)


def _evaluate_sum(fn: BlockFn, params: Any, data: BlockSet, *, split_every: int,
                  param_future: Any) -> Any:
    client = data.client or default_client(quiet=True)
    groups = data.groups()
    ref = param_future if param_future is not None else send_params(client, params, copies=len(groups))
    parts = [
        client.submit(_eval_group, fn, ref, *[data.futures[i] for i in group], pure=False)
        for group in groups
    ]
    total = tree_reduce(parts, add_terms, split_every, client=client)
    # direct=True: fetched from the worker that holds it, not relayed by the scheduler.
    return client.gather(total, direct=True)


_CACHE_LOCK = threading.Lock()
_CACHE: dict[tuple[int, int, int], tuple[Any, Any, Any, BlockSet]] = {}


def _cached_blocks(X: Any, y: Any, client: Client) -> BlockSet:
    """Persist (X, y) once per pair of objects and client; later calls with them reuse the blocks.

    Keyed by object identity and held by weak references: when X, y or the client is garbage
    collected, the entry and its blocks on the cluster go too. In-memory arrays are not cached (a
    numpy array may be changed in place between calls).
    """
    if not is_collection(X):
        return persist_data(X, y, client=client)
    key = (id(X), id(y), id(client))
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0]() is X and hit[1]() is y and hit[2]() is client:
            return hit[3]
    data = persist_data(X, y, client=client)

    def drop(_: Any, key: tuple[int, int, int] = key) -> None:
        with _CACHE_LOCK:
            entry = _CACHE.pop(key, None)
        if entry is not None:
            entry[3].release()

    refs = tuple(weakref.ref(o, drop) if o is not None else (lambda: None) for o in (X, y, client))
    with _CACHE_LOCK:
        _CACHE[key] = (refs[0], refs[1], refs[2], data)
    return data


def distributed_loss_grad(
    fn: BlockFn,
    params: Any,
    X: Any,
    y: Any = None,
    *,
    client: Client | None = None,
    split_every: int = 2,
) -> Any:
    """Loss and gradient of a sum-over-examples model, computed where the data lives.

    ``fn(params, X_block, y_block)`` returns the *sums* over the rows of one block, e.g.
    ``(loss_sum, grad_sum)``; any tuple of numbers and arrays works (add a Hessian sum for Newton's
    method) and every term is summed over all blocks. One task per group of co-located blocks,
    partial sums reduced pairwise on the workers, one result to the client.

    Parameters
    ----------
    fn : callable
        ``fn(params, X_block, y_block) -> tuple`` of per-block sums; must be importable or
        picklable (it runs on the workers). It is never called on an empty block unless every
        block of a worker's group is empty.
    params : numpy array (or any picklable object)
        The current parameters, sent to the cluster once per call.
    X : dask array, dask DataFrame, array-like, or BlockSet
        The data. Dask collections are persisted on the first call and the blocks are reused by
        later calls with the same ``X`` and ``y`` objects; pass a :class:`~dask_train.data.BlockSet` from
        :func:`~dask_train.data.persist_data` to control their lifetime yourself.
    y : dask array, dask Series or array-like, optional
        One target per row of X (ignored when X is a BlockSet).
    client : distributed.Client, optional
        Default: the BlockSet's client, else the current client, else a new embedded cluster.
    split_every : int
        Fan-in of the reduction tree.

    Returns
    -------
    tuple
        What ``fn`` returns, summed over all rows.

    Examples
    --------
    >>> def least_squares(w, Xb, yb):
    ...     r = Xb @ w - yb
    ...     return 0.5 * r @ r, Xb.T @ r
    >>> loss, grad = distributed_loss_grad(least_squares, np.zeros(3), X, y)   # doctest: +SKIP
    """
    if not callable(fn):
        raise InvalidInput([f"fn={fn!r} is invalid: pass a function fn(params, X_block, y_block)."])
    if isinstance(X, BlockSet):
        data = X
    else:
        data = _cached_blocks(X, y, client or default_client(quiet=True))
    return evaluate_sum(fn, params, data, split_every=split_every)


__all__ = ["distributed_loss_grad", "evaluate_sum"]
