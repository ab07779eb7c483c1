"""Client side of feeding: turn (X, y) dask collections into persisted blocks and find where they live."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import dask
import numpy as np
from dask.base import tokenize
from distributed import Client, Future

from dask_train.data._inputs import writable
from dask_train.data._scatter import scatter_resendable, scatter_resendable_async
from dask_train.data._stall import relax_placement, wait_persisted
from dask_train.policy._ledger import Block
from dask_train.policy._placement import balance_blocks
from dask_train.policy._scope import current_scope, in_scope

if TYPE_CHECKING:
    import dask.array as da

    from dask_train.data._block_graph import BlockGraph, StreamSource

logger = logging.getLogger(__name__)


@dataclass
class LocalSource:
    """Arrays in the client process cut into row ranges: what :func:`scatter_blocks` sent to the
    workers, kept to send a block again when the worker holding it is lost (Dask cannot
    recompute scattered data)."""

    x: np.ndarray
    y: np.ndarray | None
    w: np.ndarray | None
    bounds: list[int]
    dtype: Any = None
    # Functions applied to every block on the workers since (map_blocks_inplace), in order.
    maps: list[tuple[Callable[..., Any], tuple[Any, ...]]] = field(default_factory=list)

    def block(self, i: int) -> tuple[Any, ...]:
        """Block ``i`` as the pair (or triple) a worker holds."""
        a, b = self.bounds[i], self.bounds[i + 1]
        block = as_pair(self.x[a:b], None if self.y is None else self.y[a:b], self.dtype,
                        None if self.w is None else self.w[a:b])
        for fn, args in self.maps:
            block = fn(block, *args)
        return block


@dataclass
class BlockSet:
    """Training blocks: one future per persisted block holding the pair ``(X_block, y_block)``,
    or, streamed, the graph that reads each block where it is trained.

    The one container of training blocks, for every engine and the classical models. Made by
    :func:`persist_blocks` and :func:`scatter_blocks` (the torch engines: many blocks, the ledger
    hands them out), by :func:`~dask_train.data._stream.stream_blocks` (data read from storage
    every epoch, nothing persisted: ``futures`` is empty and ``stream`` holds each block's graph)
    and by :func:`~dask_train.data.persist_data` (full-batch sums: one group of blocks per
    worker thread, see :meth:`groups`). A feed asks :meth:`block_input` for what its task takes and
    need not know which kind it has.

    ``blocks[i]`` says where block ``i`` starts, its rows and the workers holding it;
    ``label_range`` is the smallest and largest label over all blocks, computed where the blocks
    live by :func:`persist_blocks` and :func:`scatter_blocks`, (0, 0) when y is empty or the range
    was not asked for. ``source`` holds in-memory input (see :func:`scatter_blocks`). ``client`` is the
    blocks' client; ``n_features`` and ``threads`` (the threads of each worker in the job's scope)
    are set by :func:`~dask_train.data.persist_data`, for :meth:`groups`. Call :meth:`release`
    to free the workers' memory (dropping every future does too).
    """

    futures: list[Future]
    blocks: list[Block]
    label_range: tuple[float, float] = (0.0, 0.0)
    source: LocalSource | None = None
    client: Client | None = None
    n_features: int = 0
    threads: dict[str, int] = field(default_factory=dict)
    stream: StreamSource | None = None
    note: str = ""  # how the blocks were made, and why (the Training page's log shows it)

    @property
    def streamed(self) -> bool:
        """True when the blocks are read from their graph each time they are fed (nothing is
        held on the workers between epochs)."""
        return self.stream is not None

    def block_input(self, i: int) -> Future | BlockGraph:
        """What a feed task on any worker takes to hold block ``i``: the persisted block's future
        (Dask brings it to the task's worker), or the block's graph, which the task computes
        where it runs (:func:`~dask_train.runtime._enqueue.feed_block`)."""
        if self.stream is not None:
            return self.stream.graph(i)
        return self.futures[i]

    @property
    def retries(self) -> int:
        """Times a feed task is tried again after it failed: a streamed block's read may meet
        a passing storage error; a persisted block's feed never reads anything."""
        return self.stream.retries if self.stream is not None else 0

    @classmethod
    def placed(cls, futures: list[Future], rows: list[int], holders: list[str],
               **fields: Any) -> BlockSet:
        """Blocks ``futures`` of ``rows[i]`` rows held by ``holders[i]`` ("" when unknown), one
        after the other in row order; ``fields`` are the other attributes."""
        starts = np.cumsum([0, *rows[:-1]]).tolist() if rows else []
        blocks = [Block(i, int(a), int(n), (h,) if h else ())
                  for i, (a, n, h) in enumerate(zip(starts, rows, holders))]
        return cls(list(futures), blocks, **fields)

    @property
    def n_rows(self) -> int:
        """Total rows over all blocks."""
        return sum(b.rows for b in self.blocks)

    @property
    def rows(self) -> list[int]:
        """The rows of each block."""
        return [b.rows for b in self.blocks]

    @property
    def holders(self) -> list[str]:
        """One worker holding each block (the first by address, as placement was found), "" when
        none was known."""
        return [b.holders[0] if b.holders else "" for b in self.blocks]

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

    def release(self) -> None:
        """Release every block on the cluster."""
        for fut in self.futures:
            fut.release()
        self.futures = []

    def lost(self, i: int) -> bool:
        """Whether block ``i`` is gone and must be scattered again before it is read."""
        return self.source is not None and self.futures[i].status != "finished"

    def resend_lost(self) -> int:
        """Send every block a lost worker took again from the in-memory source (from a thread
        other than the client's event loop); how many were sent."""
        lost = [i for i in range(len(self.futures)) if self.lost(i)]
        if not lost or self.client is None:
            return 0
        assert self.source is not None
        sent = scatter_resendable(self.client, [self.source.block(i) for i in lost], direct=True)
        for i, future in zip(lost, sent):
            self.futures[i] = future
        logger.warning("%d of %d blocks of the in-memory input sent again: the worker holding "
                       "them was lost", len(lost), len(self.futures))
        return len(lost)

    async def rescatter(self, client: Client, i: int) -> Future:
        """Send block ``i`` to the cluster again from the in-memory source; its new future."""
        assert self.source is not None
        [future] = await scatter_resendable_async(client, [self.source.block(i)], direct=True)
        self.futures[i] = future
        logger.info("block %d of the in-memory input sent again: the worker holding it was lost", i)
        return future


@dataclass
class SpreadValidation:
    """A validation set kept on the cluster: persisted ``(X_block, y_block)`` pairs spread over
    the workers (``fit(validation=(dask X, dask y))``), scored where they live."""

    futures: list[Future]
    rows: int

    @property
    def keys(self) -> list[str]:
        """The blocks' keys, as the workers hold them."""
        return [str(f.key) for f in self.futures]

    def release(self) -> None:
        """Let Dask forget the blocks."""
        for f in self.futures:
            f.release()


def is_dask_array(data: Any) -> bool:
    """Whether ``data`` is a dask array, without importing ``dask.array`` (0.7 s) to find out:
    if nothing imported it, nothing made one."""
    module = sys.modules.get("dask.array")
    return module is not None and isinstance(data, module.Array)


def as_dask_array(data: Any, *, chunks: int | None = None, name: str = "X") -> da.Array:
    """A dask array from a dask array, a dask DataFrame/Series or an in-memory array; a dict or
    tuple of arrays (several inputs) becomes one array of records (:mod:`dask_train.data._inputs`,
    whose errors call the data ``name``)."""
    if is_dask_array(data):
        return data
    from dask_train.data._inputs import as_records, is_several

    if is_several(data):
        return as_records(data, name=name)
    to_dask_array = getattr(data, "to_dask_array", None)
    if callable(to_dask_array):
        # lengths=True computes partition lengths so the rows of each block are known.
        return to_dask_array(lengths=True)
    import dask.array as da  # here, not at import: dt.Trainer alone does not need it

    arr = np.asarray(data)
    return da.from_array(arr, chunks=chunks or max(1, min(len(arr), 100_000)))


def _label_range(pair: tuple[np.ndarray, np.ndarray]) -> tuple[float, float]:
    y = pair[1]
    if y.dtype.names is not None:  # several targets: a loss of the user's reads them, no labels
        return (0.0, 0.0)
    return (float(y.min()), float(y.max())) if y.size else (np.inf, -np.inf)


def as_pair(x: np.ndarray, y: np.ndarray | None, dtype: Any = None,
            w: np.ndarray | None = None) -> tuple[Any, ...]:
    """One block as a contiguous ``(X_block, y_block)`` pair, ``X`` in ``dtype`` (one copy at most);
    a triple ``(X_block, y_block, weights)`` when sample weights ``w`` are given.

    Contiguous so row slices are cheap for BLAS and per-batch gathers, and writable so that
    torch.from_numpy of a batch shares its memory safely (a read-only block, such as pandas 3's,
    is the one copy; see :func:`~dask_train.data._inputs.writable`).
    """
    pair = (writable(x, dtype), None if y is None else writable(y))
    if w is None:
        return pair
    return (*pair, writable(w, np.float32))


def pair_parts(X: da.Array, y: da.Array | None, *, dtype: Any = None,
               weights: da.Array | None = None) -> list[Any]:
    """One delayed ``(X_block, y_block[, w_block])`` per row block of ``X``: what
    :func:`persist_pairs` persists and what a streamed block's task computes. ``X`` is rechunked
    to whole rows, ``y`` and ``weights`` to ``X``'s row chunks."""
    X = X.rechunk({i: -1 for i in range(1, X.ndim)}) if X.ndim > 1 else X
    x_parts = X.to_delayed().ravel()
    y_parts = [None] * len(x_parts) if y is None else list(_rows_like(y, X).to_delayed().ravel())
    w_parts = [None] * len(x_parts) if weights is None else \
        list(_rows_like(weights, X).to_delayed().ravel())
    return [dask.delayed(as_pair, pure=True)(xp, yp, dtype, wp)
            for xp, yp, wp in zip(x_parts, y_parts, w_parts)]


async def persist_pairs(client: Client, X: da.Array, y: da.Array | None, *,
                        dtype: Any = None, weights: da.Array | None = None) -> list[Future]:
    """Persist ``X`` and ``y`` as co-located ``(X_block, y_block)`` pairs: one future per block.

    The one way dask-train persists training data. One object per block holding both parts, so a
    block's features and labels can never end up on different workers, and whatever moves a
    block moves them together. ``X`` is rechunked to whole rows, ``y`` to ``X``'s row chunks.
    """
    parts = pair_parts(X, y, dtype=dtype, weights=weights)
    rows = [int(r) for r in X.chunks[0]]
    workers = await _scope_workers(client)
    # Where each block should end up, known before it is read: read there, nothing moves after.
    # A scope of one worker places there too: Dask alone may read a block anywhere.
    targets = balance_blocks(rows, [""] * len(rows), workers) \
        if len(workers) > 1 or (workers and current_scope() is not None) else None
    futures = block_tasks(client, parts, rows, targets) or client.compute(parts)
    # Inside the client's event loop distributed.wait returns a coroutine; it waits without
    # bringing any block to the client. A worker paused at its memory limit would make it
    # wait for ever: that ends in DataDoesNotFit, naming the worker.
    await wait_persisted(client, futures, what="X and y" if y is not None else "X")
    failed = [f for f in futures if f.status == "error"]
    if failed:
        try:
            await failed[0]  # re-raises the remote exception with its traceback
        finally:
            # The exception's frames hold the futures for as long as it lives (a caller may
            # keep it): let Dask forget the blocks now.
            for future in futures:
                future.release()
    if targets:
        await client.run_on_scheduler(relax_placement, [f.key for f in futures],
                                      asynchronous=True)
    return await spread_blocks(client, list(futures), rows)


#: Blocks whose tasks are this many or fewer are read by one task each (see block_tasks).
BLOCK_TASKS_MAX = 64


def block_tasks(client: Client, parts: list[Any], rows: list[int],
                targets: list[str] | None = None) -> list[Future] | None:
    """One Dask task per block that computes the block's whole pair where it runs, when the
    blocks share no task (readers of files, stores or tables, a generator per block); None
    otherwise (the caller computes the pairs' graph as it is). With ``targets``, block ``i``
    is read on worker ``targets[i]``, strictly (never elsewhere because that worker is busy),
    until :func:`persist_pairs` loosens it once in memory; elsewhere only if the worker leaves
    meanwhile (:func:`~dask_train.data._stall.schedule_stranded`).

    Why: computed as a graph, a block's features and labels are two tasks, which Dask may run
    on two workers and then bring together, and each pair is a third; on the digits job's 22
    files of ``.npy`` (X and y) that took 0.27 s to persist, against 0.12 s read by one task per
    block: no transfer, a third of the tasks. A block whose graph shares a task with another
    (a reduction over every block, say) keeps the graph: computed per block, the shared task
    would run once per block. The tasks are ordinary tasks of the cluster's graph: a lost block
    is computed again from its own tasks, as the graph would.
    """
    from dask_train.data._block_graph import StreamSource

    if len(parts) < 2:
        return None
    from dask._task_spec import convert_legacy_graph

    source = StreamSource.of(parts, rows)
    graphs, seen = [], 0
    for i in range(len(parts)):
        graph = source.graph(i)
        if len(graph.dsk) > BLOCK_TASKS_MAX:
            return None
        # A task needing a key outside the graph (a persisted chunk, held by a worker) would
        # not find it where the block is computed alone.
        if any(dep not in graph.dsk for node in convert_legacy_graph(graph.dsk).values()
               for dep in node.dependencies):
            return None
        graphs.append(graph)
        seen += len(graph.dsk)
    if seen != len({key for graph in graphs for key in graph.dsk}):
        return None  # a task shared by blocks
    # pure: the same blocks persisted twice (a search's trials) are one computation.
    # The graph travels wrapped: a dict of tasks passed to submit would be taken for tasks of
    # the cluster's own graph, run wherever Dask likes.
    # Placed, the blocks need no spreading afterwards: left to Dask, the 22 files of the
    # digits job landed 9 to 13 (say) and 2-3 blocks of 13 MB moved after the read (0.17 s).
    return [client.submit(compute_block, graph, key=f"dt-block-{tokenize(graph.key)}",
                          pure=True, workers=[targets[i]] if targets else None,
                          allow_other_workers=False)
            for i, graph in enumerate(graphs)]


def compute_block(graph: BlockGraph) -> Any:
    """Dask task: a block's own tasks (see :func:`block_tasks`), computed here, in order; a
    failing task's own error is raised."""
    from dask.local import get_sync

    return get_sync(graph.dsk, graph.key)


def _rows_like(a: da.Array, X: da.Array) -> da.Array:
    """``a`` cut into ``X``'s row blocks, whole along its other axes (a 2-D target too)."""
    return a.rechunk({0: X.chunks[0], **{i: -1 for i in range(1, a.ndim)}})


def _same(pair: Any) -> Any:
    return pair


async def _scope_workers(client: Client) -> dict[str, int]:
    """The live workers the blocks belong on (a search trial's, within its scope) -> threads."""
    info = await client.scheduler.identity()
    return in_scope({a: int(w.get("nthreads", 1)) for a, w in info.get("workers", {}).items()})


async def spread_blocks(client: Client, futures: list[Future], rows: list[int]) -> list[Future]:
    """Move blocks so every worker holds rows in proportion to its threads (see
    :func:`~dask_train.policy.balance_blocks`); the futures of the blocks, moved or not.

    A moved block is a new task on its target worker that takes the old block as its input, so
    Dask can still recompute it from the collection's graph if that worker is lost. The
    restriction is strict until the move is done, then loose: loose from the start, Dask's
    work stealing gives the move to the idle worker that holds its input while the target is
    busy, and the block stays where it was. A target that leaves meanwhile does not leave the
    move waiting: the wait sends it elsewhere
    (:func:`~dask_train.data._stall.schedule_stranded`).
    """
    workers = await _scope_workers(client)
    if not workers or not futures or (len(workers) < 2 and current_scope() is None):
        return futures
    who_has = await client.scheduler.who_has(keys=[f.key for f in futures])
    holders = [sorted(who_has.get(f.key, ()) or ("",))[0] for f in futures]
    targets = balance_blocks(rows, holders, workers)
    # The target is part of the key: two jobs spreading the same block to different workers
    # (two search trials) must get two moves, not share the first one's.
    moved = {i: client.submit(_same, futures[i], workers=[t], allow_other_workers=False,
                              pure=False, key=f"dt-spread-{futures[i].key!s}-{tokenize(t)}")
             for i, (t, h) in enumerate(zip(targets, holders)) if t != h}
    if not moved:
        return futures
    await wait_persisted(client, list(moved.values()), what="the moved blocks")
    await client.run_on_scheduler(relax_placement, [f.key for f in moved.values()],
                                  asynchronous=True)
    logger.info("moved %d of %d blocks to even out the rows per worker", len(moved), len(futures))
    return [moved.get(i, f) for i, f in enumerate(futures)]


async def scatter_blocks(client: Client, X: np.ndarray, y: np.ndarray, *,
                         weights: np.ndarray | None = None, dtype: Any = None,
                         block_rows: int = 100_000) -> BlockSet:
    """In-memory training data sent straight to the workers in blocks, spread evenly.

    Never through the graph: ``da.from_array`` of a numpy array embeds the whole array in the
    graph the scheduler receives ("Sending large graph of size 268 MiB" for the inflated digits)
    and persists it in seconds; a direct scatter sends each block once, to its worker. At least
    8 blocks per worker thread (a lost worker's share, and an epoch's tail, come in small
    pieces that the other trainers can take over), at most ``block_rows`` rows each.
    """
    info = await client.scheduler.identity()
    threads = sum(int(w.get("nthreads", 1)) for w in info.get("workers", {}).values()) or 1
    n = len(X)
    n_blocks = max(1, min(n, max(8 * threads, math.ceil(n / block_rows))))
    bounds = [int(b) for b in np.linspace(0, n, n_blocks + 1)]
    source = LocalSource(X, y, weights, bounds, dtype)
    futures = await scatter_resendable_async(client, [source.block(i) for i in range(n_blocks)],
                                             direct=True)
    rows = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    futures = await spread_blocks(client, list(futures), rows)
    return await _locate(client, futures, rows, source)


async def persist_blocks(client: Client, X: da.Array, y: da.Array, *,
                         weights: da.Array | None = None) -> BlockSet:
    """Persist X and y (and sample weights) as co-located ``(X_block, y_block[, w_block])``
    blocks and locate each block.

    One future per block, holding every part, so a block's features and labels can never end up
    on different workers, and one feed task per block moves them together when a block must move.
    Inside a scope with a cache (a search's trials, see
    :func:`~dask_train.policy._scope.use_workers`), the blocks of the same ``X`` and ``y`` on the
    same workers are persisted once and reused.
    """
    scope = current_scope()
    if scope is None or scope.cache is None:
        return await _persist_blocks(client, X, y, weights)
    key = ("blocks", X.name, y.name, None if weights is None else weights.name, scope.workers)
    cached = scope.cache.get(key)
    # A block Dask lost is recomputed ("pending" again); one that erred or was released is not.
    if isinstance(cached, BlockSet) and all(f.status in ("finished", "pending")
                                            for f in cached.futures):
        return cached
    blocks = scope.cache[key] = await _persist_blocks(client, X, y, weights)
    return blocks


async def _persist_blocks(client: Client, X: da.Array, y: da.Array,
                          weights: da.Array | None) -> BlockSet:
    futures = await persist_pairs(client, X, y, weights=weights)
    return await _locate(client, futures, [int(r) for r in X.chunks[0]])


async def _locate(client: Client, futures: list[Future], rows: list[int],
                  source: LocalSource | None = None) -> BlockSet:
    """Where each block lives, and the label range."""
    # Label range from the persisted blocks themselves: one tiny result per block, and the source
    # graph is never recomputed.
    ranges = await client.gather(client.map(_label_range, futures, pure=False), asynchronous=True)
    low = min((r[0] for r in ranges), default=0.0)
    high = max((r[1] for r in ranges), default=0.0)
    who_has = await client.scheduler.who_has(keys=[f.key for f in futures])
    return BlockSet(futures, located(futures, rows, who_has), (low, high), source, client)


def located(futures: list[Future], rows: list[int],
            who_has: Mapping[Any, Iterable[str]]) -> list[Block]:
    """The blocks of ``futures`` (``rows[i]`` rows each, one after the other) and their holders,
    from the scheduler's ``who_has``."""
    blocks, start = [], 0
    for i, (fut, n) in enumerate(zip(futures, rows)):
        blocks.append(Block(i, start, int(n), tuple(sorted(who_has.get(fut.key, ())))))
        start += int(n)
    return blocks
