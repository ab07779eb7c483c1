"""Client side of feeding: turn (X, y) dask collections into persisted blocks and find where they live."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.base import tokenize
from distributed import Client, Future, wait

from dask_train.policy._ledger import Block
from dask_train.policy._placement import balance_blocks
from dask_train.policy._scope import current_scope, in_scope

logger = logging.getLogger(__name__)


@dataclass
class BlockSet:
    """Persisted training blocks: one future per block holding the pair ``(X_block, y_block)``.

    ``label_range`` is the smallest and largest label over all blocks, computed where the blocks
    live, (0, 0) when y is empty.
    """

    futures: list[Future]
    blocks: list[Block]
    label_range: tuple[float, float] = (0.0, 0.0)

    @property
    def rows(self) -> int:
        """Total rows over all blocks."""
        return sum(b.rows for b in self.blocks)


def as_dask_array(data: Any, *, chunks: int | None = None) -> da.Array:
    """A dask array from a dask array, a dask DataFrame/Series or an in-memory array."""
    if isinstance(data, da.Array):
        return data
    to_dask_array = getattr(data, "to_dask_array", None)
    if callable(to_dask_array):
        # lengths=True computes partition lengths so the rows of each block are known.
        return to_dask_array(lengths=True)
    arr = np.asarray(data)
    return da.from_array(arr, chunks=chunks or max(1, min(len(arr), 100_000)))


def _label_range(pair: tuple[np.ndarray, np.ndarray]) -> tuple[float, float]:
    y = pair[1]
    return (float(y.min()), float(y.max())) if y.size else (np.inf, -np.inf)


def as_pair(x: np.ndarray, y: np.ndarray | None, dtype: Any = None) -> tuple[np.ndarray, Any]:
    """One block as a contiguous ``(X_block, y_block)`` pair, ``X`` in ``dtype`` (one copy at most).

    Contiguous so row slices are cheap for BLAS and per-batch gathers, and torch.from_numpy works.
    """
    return np.ascontiguousarray(x, dtype=dtype), None if y is None else np.ascontiguousarray(y)


async def persist_pairs(client: Client, X: da.Array, y: da.Array | None, *,
                        dtype: Any = None) -> list[Future]:
    """Persist ``X`` and ``y`` as co-located ``(X_block, y_block)`` pairs: one future per block.

    The one way dask-train persists training data. One object per block holding both parts, so a
    block's features and labels can never end up on different workers, and whatever moves a
    block moves them together. ``X`` is rechunked to whole rows, ``y`` to ``X``'s row chunks.
    """
    X = X.rechunk({1: -1}) if X.ndim == 2 else X
    x_parts = X.to_delayed().ravel()
    y_parts = [None] * len(x_parts) if y is None else \
        list(y.rechunk({0: X.chunks[0]}).to_delayed().ravel())
    pairs = [dask.delayed(as_pair, pure=True)(xp, yp, dtype) for xp, yp in zip(x_parts, y_parts)]
    futures = client.compute(pairs)
    # Inside the client's event loop distributed.wait returns a coroutine; it waits without
    # bringing any block to the client.
    await wait(futures)
    failed = [f for f in futures if f.status == "error"]
    if failed:
        await failed[0]  # re-raises the remote exception with its traceback
    rows = [int(r) for r in X.chunks[0]]
    return await spread_blocks(client, list(futures), rows)


def _same(pair: Any) -> Any:
    return pair


async def spread_blocks(client: Client, futures: list[Future], rows: list[int]) -> list[Future]:
    """Move blocks so every worker holds rows in proportion to its threads (see
    :func:`~dask_train.policy.balance_blocks`); the futures of the blocks, moved or not.

    A moved block is a new task on its target worker that takes the old block as its input, so
    Dask can still recompute it from the collection's graph if that worker is lost. The
    restriction is loose (``allow_other_workers``): a target that dies meanwhile must not leave
    the task waiting forever.
    """
    info = await client.scheduler.identity()
    # Within the job's scope (a search trial's workers): blocks held elsewhere move into it.
    workers = in_scope({a: int(w.get("nthreads", 1)) for a, w in info.get("workers", {}).items()})
    if not workers or not futures or (len(workers) < 2 and current_scope() is None):
        return futures
    who_has = await client.scheduler.who_has(keys=[f.key for f in futures])
    holders = [sorted(who_has.get(f.key, ()) or ("",))[0] for f in futures]
    targets = balance_blocks(rows, holders, workers)
    # The target is part of the key: two jobs spreading the same block to different workers
    # (two search trials) must get two moves, not share the first one's.
    moved = {i: client.submit(_same, futures[i], workers=[t], allow_other_workers=True,
                              pure=False, key=f"dt-spread-{futures[i].key!s}-{tokenize(t)}")
             for i, (t, h) in enumerate(zip(targets, holders)) if t != h}
    if not moved:
        return futures
    await wait(list(moved.values()))
    logger.info("moved %d of %d blocks to even out the rows per worker", len(moved), len(futures))
    return [moved.get(i, f) for i, f in enumerate(futures)]


async def persist_blocks(client: Client, X: da.Array, y: da.Array) -> BlockSet:
    """Persist X and y as co-located ``(X_block, y_block)`` pairs and locate each block.

    One future per block, holding both parts, so a block's features and labels can never end up on
    different workers, and one feed task per block moves them together when a block must move.
    Inside a scope with a cache (a search's trials, see
    :func:`~dask_train.policy._scope.use_workers`), the blocks of the same ``X`` and ``y`` on the
    same workers are persisted once and reused.
    """
    scope = current_scope()
    if scope is None or scope.cache is None:
        return await _persist_blocks(client, X, y)
    key = ("blocks", X.name, y.name, scope.workers)
    cached = scope.cache.get(key)
    # A block Dask lost is recomputed ("pending" again); one that erred or was released is not.
    if isinstance(cached, BlockSet) and all(f.status in ("finished", "pending")
                                            for f in cached.futures):
        return cached
    blocks = scope.cache[key] = await _persist_blocks(client, X, y)
    return blocks


async def _persist_blocks(client: Client, X: da.Array, y: da.Array) -> BlockSet:
    futures = await persist_pairs(client, X, y)
    # Label range from the persisted blocks themselves: one tiny result per block, and the source
    # graph is never recomputed.
    ranges = await client.gather(client.map(_label_range, futures, pure=False), asynchronous=True)
    low = min((r[0] for r in ranges), default=0.0)
    high = max((r[1] for r in ranges), default=0.0)
    who_has = await client.scheduler.who_has(keys=[f.key for f in futures])
    blocks, start = [], 0
    for i, (fut, rows) in enumerate(zip(futures, X.chunks[0])):
        blocks.append(Block(i, start, int(rows), tuple(sorted(who_has.get(fut.key, ())))))
        start += int(rows)
    return BlockSet(futures, blocks, (low, high))
