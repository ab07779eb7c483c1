"""Whether a fit persists its training data on the workers or streams it from storage each epoch.

Pure: plain numbers in, a mode and the sentence that explains it out.
"""

from __future__ import annotations

from collections.abc import Mapping

#: ``data=`` values a fit accepts.
DATA_MODES = ("auto", "persist", "stream")

#: The share of the workers' summed memory limits that ``data="auto"`` lets persisted data take.
#: Dask starts spilling managed memory to disk at 60% of a worker's limit and pauses it at 80%;
#: the rest of the worker (torch, the model, the optimizer, batches in flight, the feed queues)
#: needs room too, so half is the most the data may take without spilling.
MEMORY_SHARE = 0.5

#: A block whose tasks hold more than this in arrays carries its data in the graph (``da.from_array``
#: of an in-memory array): every streamed read would send it again, so ``auto`` persists it once.
EMBEDDED_LIMIT = 2**20


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns


def choose_data_mode(mode: str, *, nbytes: int, memory_limits: Mapping[str, int],
                     share: float = MEMORY_SHARE, graph_bytes: int = 0) -> tuple[str, str]:
    """``("persist" | "stream", why)`` for a fit given ``data=mode``.

    ``auto`` persists data whose ``nbytes`` fit in ``share`` of the workers' summed memory
    limits, and streams the rest; with no limit set on some worker (0), the limit is unknown and
    the data is persisted. A graph whose block's tasks hold more than :data:`EMBEDDED_LIMIT` of
    arrays (``graph_bytes``) holds its data and is persisted.

    Examples
    --------
    >>> choose_data_mode("auto", nbytes=3 * 2**30, memory_limits={"a": 2**30, "b": 2**30})[0]
    'stream'
    >>> choose_data_mode("auto", nbytes=2**20, memory_limits={"a": 2**30})[0]
    'persist'
    """
    if mode != "auto":
        return mode, f"data={mode!r}"
    total = sum(int(v) for v in memory_limits.values())
    if not memory_limits or any(int(v) <= 0 for v in memory_limits.values()):
        return "persist", (f"data='auto': the data holds {_size(nbytes)} and the workers have no "
                           "memory limit set: persisting")
    if graph_bytes > EMBEDDED_LIMIT:
        return "persist", (f"data='auto': a block's graph holds {_size(graph_bytes)} (in-memory "
                           "data inside the graph, read once): persisting")
    room = share * total
    head = (f"data='auto': the data holds {_size(nbytes)}; {share:.0%} of the "
            f"{len(memory_limits)} workers' memory limits ({_size(total)}) is {_size(room)}")
    if nbytes <= room:
        return "persist", f"{head}: persisting"
    return "stream", f"{head}: streaming every epoch from storage"


def check_data_mode(data: object, *, in_memory: bool, full_batch: bool,
                    name: str = "data") -> list[str]:
    """Problems with ``data=`` (empty when valid); ``in_memory``: X is a numpy array or the like,
    ``full_batch``: the model is an ArrayModel (its solvers read every block every step);
    ``name``: the parameter's name where it is not ``data`` (``dt.run``'s ``data_mode``)."""
    if not isinstance(data, str) or data not in DATA_MODES:
        return [f"{name}={data!r} is invalid: use 'auto' (persist what fits in {MEMORY_SHARE:.0%} "
                "of the workers' memory, stream the rest), 'persist' or 'stream'."]
    if data == "stream" and in_memory:
        return [f"{name}='stream' reads blocks from storage on the workers, but X is in memory: "
                "pass a dask array read from storage (da.from_zarr, dt.from_npy, a dask "
                f"DataFrame), or use {name}='auto' or 'persist'."]
    if data == "stream" and full_batch:
        return [f"{name}='stream' is for torch and Keras models: an ArrayModel's solvers read "
                f"every block at every step, so its data is persisted; use {name}='auto' or "
                "'persist'."]
    return []


#: ``blocks_ahead="auto"``: blocks granted to each trainer before its first report, and the most
#: a trainer starved of streamed blocks may grow to. Two hide a read behind the training of one
#: block; more only help where a block trains faster than the next is read (small blocks, an
#: object store's latency), so the depth grows where a trainer waited, and only while its
#: worker has room below Dask's memory target (``engines.harness.role.TrainerRole.block``).
AUTO_BLOCKS_AHEAD = (2, 8)


def read_ahead(blocks_ahead: int | str) -> tuple[int, int]:
    """``(blocks granted ahead at the start, the most they may grow to)`` for ``blocks_ahead``.

    Examples
    --------
    >>> read_ahead("auto")
    (2, 8)
    >>> read_ahead(3)
    (3, 3)
    """
    if blocks_ahead == "auto":
        return AUTO_BLOCKS_AHEAD
    return int(blocks_ahead), int(blocks_ahead)
