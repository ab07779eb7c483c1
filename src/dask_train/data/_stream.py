"""Streamed training data: each block read from its graph on the worker that trains it, every
epoch, and never persisted.

For data larger than the cluster's memory. Persisting it makes Dask spill blocks to the workers'
local disks and read them back (every byte read from the source, written to scratch and read
again; the scratch must hold the whole data set). Streamed, a block is one feed task on its
trainer's worker that computes the block's own tasks there (a zarr, npy or parquet reader, or
any dask computation: straight from storage to the worker, never through the client) and puts
the result in the trainer's queue. The queue is bounded by credit (``blocks_ahead``), so a
trainer holds at most that many blocks, and a block is freed once its trainer moves past it.

The ledger, shuffling, exactly-once consumption, resume and recovery work on block indices and
do not change: a :class:`~dask_train.data.BlockSet` with ``stream`` set gives a feed the block's
graph (:class:`~dask_train.data._block_graph.BlockGraph`) where a persisted one gives its future.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from distributed import Client

from dask_train.data._block_graph import BlockGraph, StreamSource
from dask_train.data._blocks import BlockSet, pair_parts
from dask_train.data._stall import wait_futures
from dask_train.errors import DataUnreadable
from dask_train.policy._ledger import Block
from dask_train.policy._placement import balance_blocks
from dask_train.policy._scope import in_scope

if TYPE_CHECKING:
    import dask.array as da

logger = logging.getLogger(__name__)

def data_nbytes(*arrays: Any) -> int:
    """Bytes of the given dask arrays (None skipped), from their shapes and dtypes."""
    total = 0
    for a in arrays:
        if a is not None:
            total += int(np.prod(a.shape, dtype=np.int64)) * int(a.dtype.itemsize)
    return total


def graph_bytes(graph: BlockGraph) -> int:
    """Bytes of in-memory arrays inside a block's tasks: ``da.from_array`` of a numpy array puts
    each block's rows into the graph, and a streamed feed would send them again every epoch
    (a store's reader holds a file name or a zarr array object, 0 here)."""
    return sum(int(v.value.nbytes) for v in graph.dsk.values()
               if isinstance(getattr(v, "value", None), np.ndarray))


async def stream_blocks(client: Client, X: da.Array, y: da.Array | None, *,
                        weights: da.Array | None = None, dtype: Any = None, labels: bool = False,
                        timeout: float = 60.0, source: StreamSource | None = None) -> BlockSet:
    """Training blocks read from storage on the trainers' workers each epoch, nothing persisted.

    Each block gets a home worker (rows spread in proportion to the workers' threads, see
    :func:`~dask_train.policy.balance_blocks`): the ledger gives it to the trainer there, so
    every epoch a block is read by the same worker while that trainer lives. Before returning,
    every worker of the job reads the smallest block once (:func:`check_readable`): a path or URL
    a worker cannot read fails here, named with the worker, not in the middle of an epoch.

    Parameters
    ----------
    client : distributed.Client
    X, y, weights : dask arrays
        The training data (``y``, ``weights`` cut to ``X``'s row blocks).
    dtype : numpy dtype, optional
        The dtype X's blocks are read into (the model's), in the reading task.
    labels : bool
        Compute the labels' range (for the classification checks): a reduction over ``y``.
    timeout : float
        Seconds the read check may take.
    source : StreamSource, optional
        The blocks' graphs when the caller already made them (:func:`~.pair_parts`).
    """
    rows = [int(r) for r in X.chunks[0]]
    if source is None:
        source = StreamSource.of(pair_parts(X, y, dtype=dtype, weights=weights), rows)
    info = await client.scheduler.identity()
    workers = in_scope({a: int(w.get("nthreads", 1)) for a, w in info.get("workers", {}).items()})
    homes = balance_blocks(rows, [""] * len(rows), workers) if workers else [""] * len(rows)
    starts = np.cumsum([0, *rows[:-1]]).tolist() if rows else []
    blocks = [Block(i, int(a), n, (h,) if h else ())
              for i, (a, n, h) in enumerate(zip(starts, rows, homes))]
    if rows:
        await check_readable(client, source, sorted(workers), timeout=timeout)
    label_range = (0.0, 0.0)
    if labels and y is not None and y.dtype.names is None and rows:
        low, high = await client.gather(client.compute([y.min(), y.max()]), asynchronous=True)
        label_range = (float(low), float(high))
    return BlockSet([], blocks, label_range, client=client, stream=source)


def _read_check(graph: BlockGraph) -> dict[str, Any]:
    """Task: read ``graph``'s block here; its size and the seconds it took (the block stays)."""
    t = time.perf_counter()
    pair = graph.read()
    return {"rows": len(pair[0]), "nbytes": sum(int(getattr(p, "nbytes", 0)) for p in pair),
            "seconds": time.perf_counter() - t}


async def check_readable(client: Client, source: StreamSource, workers: list[str], *,
                         timeout: float) -> list[dict[str, Any]]:
    """Read the smallest block once on each of ``workers``; raise
    :class:`~dask_train.errors.DataUnreadable` naming every worker that could not, with the
    cause and the fix. Each worker's result (rows, bytes, seconds) otherwise.

    A read on every worker, not one: a worker without ``s3fs``, without the credentials or
    without the shared disk fails only there.
    """
    i = int(np.argmin(source.rows))
    graph = source.graph(i)
    from dask.base import tokenize

    token = tokenize(source.keys[i], time.time_ns())
    # Retried as a feed's read is: a passing storage error must not fail the job here either.
    futures = [client.submit(_read_check, graph, workers=[w], allow_other_workers=False,
                             pure=False, retries=source.retries, key=f"dt-read-check-{token}-{w}")
               for w in workers]
    try:
        await wait_futures(futures, timeout=timeout)
    except TimeoutError:
        pass  # the pending ones are named below
    problems, results = [], []
    for w, fut in zip(workers, futures):
        if fut.status == "finished":
            results.append(await fut)
        elif fut.status == "error":
            exc = await fut.exception()
            problems.append(f"worker {w} cannot read the training data: {exc}")
        else:
            problems.append(f"worker {w} did not read block {i} of the training data within "
                            f"{timeout:g} s: check its logs and that it can reach the storage, "
                            "or raise timeout=")
    for fut in futures:
        fut.release()
    if problems:
        raise DataUnreadable(problems)
    return results
