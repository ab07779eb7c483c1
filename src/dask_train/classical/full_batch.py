"""Full-batch training of classical models: per-block loss/gradient sums, reduced on the workers.

Many models minimise a loss that is a sum over examples, so the loss, the gradient and the Hessian
split into per-block sums. This module computes them the fast way on a Dask cluster:

* the training blocks are persisted once on the workers (:func:`persist_data`) and reused by every
  iteration, never re-read from the source;
* the parameters go to the cluster once per iteration (:func:`send_params`: tiny ones inside the
  task messages, larger ones one ``scatter`` straight to one worker, never a broadcast; see there
  for the measurements);
* one task per group of blocks that live on the same worker evaluates the user's function on each of
  its blocks and sums the results, so no block ever moves;
* the partial sums are combined pairwise on the workers (:func:`tree_reduce`) and the client
  receives one result per call.

The solvers that drive these sums (gradient descent, L-BFGS, Newton, proximal gradient) are in
:mod:`dask_train.classical._solvers`.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import dask.array as da
import numpy as np
from distributed import Client, Future, get_client, wait

from dask_train.data._blocks import as_dask_array, as_pair, persist_pairs
from dask_train.errors import InvalidInput
from dask_train.policy._scope import current_scope, in_scope

BlockFn = Callable[..., Any]


# -- tree reduction ------------------------------------------------------------------------------


def _combine_group(combine: Callable[[Any, Any], Any], *parts: Any) -> Any:
    # ``combine`` stays a binary function (operator.add, np.add, ...); a fan-in above 2 folds it.
    return functools.reduce(combine, parts)


def tree_reduce(
    futures: Sequence[Future],
    combine: Callable[[Any, Any], Any] = operator.add,
    split_every: int = 2,
    *,
    client: Client | None = None,
) -> Future:
    """Combine the results of ``futures`` on the workers, ``split_every`` at a time, into one future.

    Each level submits one task per group of ``split_every`` neighbouring futures; Dask runs it on
    the worker that already holds most of its inputs, so results are combined where they live and
    nothing is gathered to the client. Put futures that live on the same worker next to each other
    (as :func:`distributed_loss_grad` does) and the first levels move no data at all.

    Parameters
    ----------
    futures : sequence of distributed.Future
        At least one future. A single future is returned as it is.
    combine : callable
        Binary, associative function of two results, e.g. ``operator.add``. With ``split_every > 2``
        it is folded over each group.
    split_every : int
        Fan-in of the tree, >= 2. A larger fan-in means fewer levels (fewer task round trips) but
        more inputs moved to one worker per task.
    client : distributed.Client, optional
        Default: the client of the first future.

    Returns
    -------
    distributed.Future
        The combined result; call ``.result()`` to receive it (one transfer to the client).

    Examples
    --------
    >>> import operator
    >>> parts = client.map(lambda i: np.full(3, i), range(5))   # doctest: +SKIP
    >>> tree_reduce(parts, operator.add).result()               # doctest: +SKIP
    array([10, 10, 10])
    """
    problems = []
    if not futures:
        problems.append(
            "futures=[] is invalid: tree_reduce needs at least one future; pass the futures whose "
            "results to combine."
        )
    if isinstance(split_every, bool) or not isinstance(split_every, int) or split_every < 2:
        problems.append(f"split_every={split_every!r} is invalid: use an integer >= 2 (the fan-in).")
    if not callable(combine):
        problems.append(f"combine={combine!r} is invalid: use a binary function such as operator.add.")
    if problems:
        raise InvalidInput(problems)
    level = list(futures)
    if len(level) == 1:
        return level[0]
    client = client or level[0].client
    while len(level) > 1:
        nxt = []
        for start in range(0, len(level), split_every):
            group = level[start : start + split_every]
            if len(group) == 1:  # an odd one out moves up a level unchanged
                nxt.append(group[0])
                continue
            # pure=False: the user's combine need not be deterministic, and equal inputs in two
            # calls must not share a key that one call's release could take from the other.
            nxt.append(client.submit(_combine_group, combine, *group, pure=False))
        # The intermediate futures can be dropped here: the scheduler keeps each result until
        # the tasks that depend on it have run.
        level = nxt
    return level[0]


def add_terms(a: Any, b: Any) -> Any:
    """Add two results of a block function: numbers, arrays, or tuples/lists of them, term by term.

    Examples
    --------
    >>> add_terms((1.0, np.ones(2)), (2.0, np.ones(2)))
    (3.0, array([2., 2.]))
    """
    if isinstance(a, (tuple, list)):
        return type(a)(add_terms(x, y) for x, y in zip(a, b))
    return a + b


# -- persisted blocks -----------------------------------------------------------------------------


@dataclass
class BlockData:
    """Training blocks persisted on the workers: one future per block holding ``(X_block, y_block)``.

    Made by :func:`persist_data`; pass it to :func:`distributed_loss_grad` in place of ``X, y`` to
    reuse the blocks across calls. ``holders[i]`` is the worker that holds block ``i``. Call
    :meth:`release` to free the workers' memory (dropping the object does too).
    """

    futures: list[Future]
    rows: list[int]
    holders: list[str]
    n_features: int
    client: Client
    threads: dict[str, int] = field(default_factory=dict)

    @property
    def n_rows(self) -> int:
        """Total rows over all blocks."""
        return sum(self.rows)

    def release(self) -> None:
        """Release every block on the cluster."""
        for fut in self.futures:
            fut.release()
        self.futures = []

    def groups(self) -> list[list[int]]:
        """Block indices grouped by holder, as many groups per worker as it has threads.

        One evaluation task per group instead of per block: on 2 workers with 50 blocks that is 2
        tasks per iteration instead of 50, and a task round trip (6-11 ms here) costs more than a
        pass over a 40 MB block. The grouping only saves tasks: Dask still runs each group where
        its blocks are, and if a worker was lost and its blocks recomputed elsewhere, a group that
        now spans two workers costs a transfer, never a wrong sum.
        """
        by_worker: dict[str, list[int]] = {}
        for i, holder in enumerate(self.holders):
            by_worker.setdefault(holder, []).append(i)
        groups = []
        for worker, idx in sorted(by_worker.items()):
            n = max(1, min(len(idx), self.threads.get(worker, 1)))
            size = math.ceil(len(idx) / n)
            groups += [idx[s : s + size] for s in range(0, len(idx), size)]
        return groups


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


def persist_data(
    X: Any, y: Any = None, *, client: Client | None = None, dtype: Any = np.float64
) -> BlockData:
    """Persist ``X`` (and ``y``) on the workers as co-located blocks and locate each block.

    Parameters
    ----------
    X : dask array, dask DataFrame or array-like, shape (n_rows, n_features)
    y : dask array, dask Series or array-like, shape (n_rows,), optional
    client : distributed.Client, optional
        Default: the current client (:func:`default_client`).
    dtype : numpy dtype
        Dtype of the persisted ``X`` blocks (float64 by default, what the solvers expect).

    Returns
    -------
    BlockData

    Examples
    --------
    >>> data = persist_data(X, y)                              # doctest: +SKIP
    >>> loss, grad = distributed_loss_grad(fn, w, data)        # doctest: +SKIP
    >>> data.release()                                         # doctest: +SKIP
    """
    client = client or default_client()
    if not hasattr(X, "dask") and not hasattr(y, "dask"):
        return _scatter_local(np.asarray(X), None if y is None else np.asarray(y), client, dtype)
    Xd, yd = _to_2d_dask(X, y)
    # The solver's dtype is applied by the persisting task itself: one copy at most.
    futures = client.sync(persist_pairs, client, Xd, yd, dtype=dtype)
    who_has = client.who_has(futures)
    info = client.scheduler_info(n_workers=-1)["workers"]
    threads = in_scope({addr: int(w.get("nthreads", 1)) for addr, w in info.items()})
    holders = [sorted(who_has.get(f.key, ("",)))[0] for f in futures]
    rows = [int(r) for r in Xd.chunks[0]]
    return BlockData(futures, rows, holders, int(Xd.shape[1]), client, threads)


_LOCAL_BLOCK_BYTES = 8 * 2**20


def _scatter_local(X: np.ndarray, y: np.ndarray | None, client: Client, dtype: Any) -> BlockData:
    """In-memory arrays go straight to the workers with ``scatter``, never through the scheduler.

    As many blocks as worker threads, but none below 8 MiB: small data stays one block on one
    worker, where an iteration costs one task round trip instead of two tree levels.
    """
    if X.ndim != 2 or (y is not None and (y.ndim != 1 or len(y) != len(X))):
        raise InvalidInput([
            f"X has shape {X.shape} and y has shape {None if y is None else y.shape}: pass a 2-D X "
            "and a 1-D y with one value per row of X."
        ])
    info = client.scheduler_info(n_workers=-1)["workers"]
    threads = in_scope({addr: int(w.get("nthreads", 1)) for addr, w in info.items()})
    n_blocks = max(1, min(sum(threads.values()) or 1, X.nbytes // _LOCAL_BLOCK_BYTES, len(X)))
    bounds = np.linspace(0, len(X), n_blocks + 1).astype(int)
    blocks = [
        as_pair(X[a:b], None if y is None else y[a:b], dtype) for a, b in zip(bounds[:-1], bounds[1:])
    ]
    # Only to the job's workers (all of them, or a search trial's own).
    futures = client.scatter(blocks, hash=False, direct=True,
                             workers=sorted(threads) if current_scope() is not None else None)
    who_has = client.who_has(futures)
    holders = [sorted(who_has.get(f.key, ("",)))[0] for f in futures]
    rows = [int(b - a) for a, b in zip(bounds[:-1], bounds[1:])]
    return BlockData(list(futures), rows, holders, int(X.shape[1]), client, threads)


def map_blocks_inplace(data: BlockData, fn: Callable[..., Any], *args: Any) -> None:
    """Replace each block of ``data`` by ``fn(block, *args)``, computed where the block lives.

    Used to encode labels after validation without another pass over the source.
    """
    new = data.client.map(fn, data.futures, *[[a] * len(data.futures) for a in args], pure=False)
    wait(new)
    failed = [f for f in new if f.status == "error"]
    if failed:
        failed[0].result()
    old, data.futures = data.futures, list(new)
    for fut in old:
        fut.release()


def default_client() -> Client:
    """The current default Dask client, or a new embedded cluster from :func:`dask_train.connect`."""
    try:
        return get_client()
    except ValueError:
        from dask_train.runtime import connect  # late: the runtime sits above this layer

        return connect(quiet=True)


# -- parameters to the workers ---------------------------------------------------------------------


# Below this many bytes in all task arguments together, parameters travel inside the tasks.
EMBED_PARAMS_BYTES = 2**18


def send_params(client: Client, params: Any, *, copies: int = 1) -> Any:
    """Send the parameters of one iteration to the cluster once; return what the tasks take.

    ``copies`` is the number of tasks that will take them. Small parameters (``copies`` x size up
    to :data:`EMBED_PARAMS_BYTES`) are returned as they are and travel inside the task messages;
    larger ones are scattered once, without ``broadcast``, and the returned future is what the
    tasks take.

    Why, measured on a shared 2-core machine with 2 workers (``benchmarks/classical.py`` part c:
    median ms of one evaluation over 8 small blocks in 2 groups; the client on loopback / behind a
    1 Gbit/s link; ``benchmarks/results/classical.md``):

    ==================  ============  ============  ==============
    parameters          400 B         800 kB        40 MB
    ==================  ============  ============  ==============
    in task arguments   30.4 / 33.8   35.1 / 46.6   139.0 / 730.5
    scatter             35.9 / 34.9   33.7 / 35.6    61.9 / 384.9
    scatter(direct)     37.3 / 36.5   30.9 / 35.4    50.6 / 370.4
    scatter(broadcast)  34.1 / 37.1   34.5 / 42.3    89.0 / 414.4
    scatter+replicate   38.4 / 37.4   41.8 / 43.9    95.9 / 410.9
    ==================  ============  ============  ==============

    * In the task arguments the parameters ride along with the messages that start the tasks:
      no extra round trip, a few ms cheaper for tiny parameters; but every task carries its own
      copy through the scheduler (twice the bytes with 2 groups, 2x slower at 40 MB), and the
      design rule is that tensors never pass through the scheduler: only below 256 KiB in all.
    * ``scatter(direct=True)`` costs a round trip before the tasks can be submitted, then one copy
      goes from the client straight to one worker whatever the number of workers (without
      ``direct`` the scheduler relays it); tasks on other workers fetch it worker-to-worker, and
      a worker that already has it is a source for the next. Fastest from 800 kB up.
    * ``scatter(broadcast=True)`` and ``replicate`` upload or copy it to every worker first, so
      they wait for every copy, and the Active Memory Manager's ReduceReplicas policy drops the
      extra copies within seconds anyway: nothing may depend on replicas surviving, and nothing
      here does.
    """
    nbytes = getattr(params, "nbytes", None)
    if nbytes is not None and nbytes * max(1, copies) <= EMBED_PARAMS_BYTES:
        return params
    # direct=True: from the client straight to a worker; without it the scheduler relays the data.
    return client.scatter(params, hash=False, direct=True)


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
    fn: BlockFn, params: Any, data: BlockData, *, split_every: int = 2, param_future: Any = None
) -> Any:
    """``sum over blocks of fn(params, X_block, y_block)``, reduced on the workers; one result back."""
    client = data.client
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
_CACHE: dict[tuple[int, int, int], tuple[Any, Any, Any, BlockData]] = {}


def _cached_blocks(X: Any, y: Any, client: Client) -> BlockData:
    """Persist (X, y) once per pair of objects and client; later calls with them reuse the blocks.

    Keyed by object identity and held by weak references: when X, y or the client is garbage
    collected, the entry and its blocks on the cluster go too. In-memory arrays are not cached (a
    numpy array may be changed in place between calls).
    """
    if not hasattr(X, "dask"):
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
    X : dask array, dask DataFrame, array-like, or BlockData
        The data. Dask collections are persisted on the first call and the blocks are reused by
        later calls with the same ``X`` and ``y`` objects; pass a :class:`BlockData` from
        :func:`persist_data` to control their lifetime yourself.
    y : dask array, dask Series or array-like, optional
        One target per row of X (ignored when X is a BlockData).
    client : distributed.Client, optional
        Default: the BlockData's client, else the current client, else a new embedded cluster.
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
    if isinstance(X, BlockData):
        data = X
    else:
        data = _cached_blocks(X, y, client or default_client())
    return evaluate_sum(fn, params, data, split_every=split_every)


__all__ = [
    "BlockData",
    "add_terms",
    "default_client",
    "distributed_loss_grad",
    "evaluate_sum",
    "map_blocks_inplace",
    "persist_data",
    "send_params",
    "tree_reduce",
]
