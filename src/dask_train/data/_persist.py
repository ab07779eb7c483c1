"""Full-batch blocks: ``(X, y)`` persisted on the workers for sums over every row.

The classical models and the numpy sync engine evaluate a function on every block each iteration
(see :func:`~dask_train.classical.distributed_loss_grad`): :func:`persist_data` persists the data
once as co-located ``(X_block, y_block)`` pairs and records, in the one block container
:class:`~dask_train.data.BlockSet`, where each block lives and how many threads each worker has,
so one task per group of co-located blocks does the work (:meth:`BlockSet.groups`). The torch
engines persist through :func:`~dask_train.data.persist_blocks` instead: many small blocks that
the ledger hands out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from distributed import Client

from dask_train.data._blocks import (
    BlockSet,
    LocalSource,
    as_dask_array,
    as_pair,
    located,
    persist_pairs,
)
from dask_train.data._cluster import live_workers
from dask_train.data._inputs import is_collection
from dask_train.data._scatter import scatter_resendable
from dask_train.data._stall import wait_futures
from dask_train.errors import InvalidInput
from dask_train.policy._scope import current_scope, in_scope

if TYPE_CHECKING:
    import dask.array as da


def _to_2d_dask(X: Any, y: Any) -> tuple[da.Array, da.Array | None]:
    X = as_dask_array(X)
    problems = []
    if X.ndim != 2:
        problems.append(f"X has {X.ndim} dimension(s) (shape {X.shape}): pass a 2-D array (rows, features).")
    y_arr = None if y is None else as_dask_array(y)
    if y_arr is not None and y_arr.ndim != 1:
        problems.append(f"y has shape {y_arr.shape}: pass a 1-D array with one label per row of X.")
    if problems:
        raise InvalidInput(problems)
    if any(math.isnan(c) for c in X.chunks[0]):
        X = X.compute_chunk_sizes()
    if y_arr is not None and any(math.isnan(c) for c in y_arr.chunks[0]):
        y_arr = y_arr.compute_chunk_sizes()
    if y_arr is not None and y_arr.shape[0] != X.shape[0]:
        raise InvalidInput([
            f"y has {y_arr.shape[0]} rows but X has {X.shape[0]}: pass one label per row of X."
        ])
    X = X.rechunk({1: -1})  # whole rows per block: the per-block functions see every feature
    if y_arr is not None:
        y_arr = y_arr.rechunk({0: X.chunks[0]})
    return X, y_arr


def persist_data(X: Any, y: Any = None, *, client: Client, dtype: Any = np.float64) -> BlockSet:
    """Persist ``X`` (and ``y``) on the workers as co-located blocks and locate each block.

    Parameters
    ----------
    X : dask array, dask DataFrame or array-like, shape (n_rows, n_features)
    y : dask array, dask Series or array-like, shape (n_rows,), optional
    client : distributed.Client
        The cluster to persist on (callers above the runtime find one with
        :func:`~dask_train.runtime.default_client`).
    dtype : numpy dtype
        Dtype of the persisted ``X`` blocks (float64 by default, what the solvers expect).

    Returns
    -------
    BlockSet
        With ``client``, ``n_features`` and ``threads`` set, ready for :meth:`BlockSet.groups`.

    Examples
    --------
    >>> data = persist_data(X, y, client=client)               # doctest: +SKIP
    >>> loss, grad = dt.distributed_loss_grad(fn, w, data)     # doctest: +SKIP
    >>> data.release()                                         # doctest: +SKIP
    """
    if not is_collection(X) and not is_collection(y):
        return _scatter_local(np.asarray(X), None if y is None else np.asarray(y), client, dtype)
    Xd, yd = _to_2d_dask(X, y)
    # The solver's dtype is applied by the persisting task itself: one copy at most.
    futures = client.sync(persist_pairs, client, Xd, yd, dtype=dtype)
    who_has = client.who_has(futures)
    threads = _threads(client)
    rows = [int(r) for r in Xd.chunks[0]]
    return BlockSet(futures, located(futures, rows, who_has), client=client,
                    n_features=int(Xd.shape[1]), threads=threads)


_LOCAL_BLOCK_BYTES = 8 * 2**20


def _threads(client: Client) -> dict[str, int]:
    """The job's live workers and their threads, asked of the scheduler now (its cached view
    can be empty for a moment: see :func:`~dask_train.data._cluster.live_workers`)."""
    return in_scope({a: int(w.get("nthreads", 1)) for a, w in live_workers(client).items()})


def _scatter_local(X: np.ndarray, y: np.ndarray | None, client: Client, dtype: Any) -> BlockSet:
    """In-memory arrays go straight to the workers with ``scatter``, never through the scheduler.

    As many blocks as worker threads, but none below 8 MiB: small data stays one block on one
    worker, where an iteration costs one task round trip instead of two tree levels.
    """
    if X.ndim != 2 or (y is not None and (y.ndim != 1 or len(y) != len(X))):
        raise InvalidInput([
            f"X has shape {X.shape} and y has shape {None if y is None else y.shape}: pass a 2-D X "
            "and a 1-D y with one value per row of X."
        ])
    threads = _threads(client)
    n_blocks = max(1, min(sum(threads.values()) or 1, X.nbytes // _LOCAL_BLOCK_BYTES, len(X)))
    bounds = np.linspace(0, len(X), n_blocks + 1).astype(int)
    blocks = [
        as_pair(X[a:b], None if y is None else y[a:b], dtype) for a, b in zip(bounds[:-1], bounds[1:])
    ]
    # Only to the job's workers (all of them, or a search trial's own).
    futures = scatter_resendable(client, blocks, direct=True,
                                 workers=sorted(threads) if current_scope() is not None else None)
    who_has = client.who_has(futures)
    rows = [int(b - a) for a, b in zip(bounds[:-1], bounds[1:])]
    # Kept to send a block again when its worker dies (Dask cannot recompute scattered data).
    source = LocalSource(X, y, None, [int(b) for b in bounds], dtype)
    return BlockSet(list(futures), located(list(futures), rows, who_has), client=client,
                    n_features=int(X.shape[1]), threads=threads, source=source)


def map_blocks_inplace(data: BlockSet, fn: Callable[..., Any], *args: Any) -> None:
    """Replace each block of ``data`` by ``fn(block, *args)``, computed where the block lives.

    Used to encode labels after validation without another pass over the source.
    """
    assert data.client is not None, "made by persist_data, which sets the client"
    new = data.client.map(fn, data.futures, *[[a] * len(data.futures) for a in args], pure=False)
    # Through the data's own client: distributed.wait uses the default one, which may be
    # another client or none (a client made with set_as_default=False).
    data.client.sync(wait_futures, new)
    failed = [f for f in new if f.status == "error"]
    if failed:
        failed[0].result()
    old, data.futures = data.futures, list(new)
    for fut in old:
        fut.release()
    if data.source is not None:  # a block sent again from the client gets the same changes
        data.source.maps.append((fn, args))
