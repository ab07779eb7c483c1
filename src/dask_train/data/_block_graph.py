"""A block's own tasks, carried to the worker that reads it: the streamed blocks' source.

Kept apart from :mod:`dask_train.data._stream` (which makes the streamed
:class:`~dask_train.data.BlockSet`) so that the block container and the worker's feed task can
name these types without importing the client-side code that builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dask_train.errors import BlockReadError

#: Tries after the first of a block's read that failed (Dask's ``retries=`` on the feed task):
#: object stores answer an occasional request with a passing error.
READ_RETRIES = 2


class BlockGraph:
    """The tasks that compute one block: what a feed task runs on its worker to read it.

    A plain class, not a dict: Dask would take a dict of tasks passed to ``submit`` for tasks
    of its own graph and run them wherever it likes; wrapped, they run inside the feed task.
    """

    __slots__ = ("dsk", "index", "key", "rows", "tries")

    def __init__(self, dsk: dict[Any, Any], key: Any, *, index: int, rows: int,
                 tries: int) -> None:
        self.dsk, self.key, self.index, self.rows, self.tries = dsk, key, index, rows, tries

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.dsk, self.key, self.index, self.rows, self.tries)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.dsk, self.key, self.index, self.rows, self.tries = state

    def read(self) -> tuple[Any, ...]:
        """Compute the block here, in this thread: its ``(X_block, y_block[, w_block])``.

        Raises :class:`~dask_train.errors.BlockReadError` naming the block, the key of the task
        that failed (a reader's, usually), this worker and the cause with its fix.
        """
        from dask.local import get_sync

        release_freed_memory()
        running: list[Any] = [self.key]

        def pretask(key: Any, dsk: Any, state: Any) -> None:
            running[0] = key  # one task at a time here: the last one started is the one failing

        try:
            pair: tuple[Any, ...] = get_sync(self.dsk, self.key,
                                             callbacks=[(None, None, pretask, None, None)])
        except Exception as exc:
            raise BlockReadError(
                f"block {self.index} of the training data ({self.rows} rows) could not be read "
                f"on {_here()} after {self.tries} tr{'y' if self.tries == 1 else 'ies'}: task "
                f"{running[0]!r} raised {type(exc).__name__}: {exc}; {_fix(exc)}"
            ) from exc
        return pair


_LIBC: list[Any] = []  # glibc, loaded once per process ([None] where there is none)


def release_freed_memory() -> None:
    """Give the memory of blocks already trained on back to the operating system (glibc's
    ``malloc_trim``), before reading the next one.

    A block of a few MiB is carved from the heap once glibc's mmap threshold has grown past its
    size; freed, its pages stay in the process, scattered between live objects, and a worker
    that streams blocks through its heap grows by tens of MiB over an epoch: Dask counts that as
    unmanaged memory and, near its limit, spills or pauses. Trimmed before each read, the
    process holds what it uses. A no-op where the C library is not glibc.
    """
    if not _LIBC:
        try:
            import ctypes

            _LIBC.append(ctypes.CDLL("libc.so.6"))
        except OSError:
            _LIBC.append(None)
    libc = _LIBC[0]
    if libc is not None:
        libc.malloc_trim(0)


def _here() -> str:
    from distributed import get_worker

    try:
        return f"worker {get_worker().address}"
    except ValueError:  # not in a worker: a test, or the client probing
        return "this process"


@dataclass
class StreamSource:
    """Each block's graph, cut from the data's graph on first use and kept.

    ``dsk`` is the whole graph of every block's pair, materialized once: cutting one block's
    tasks from it (:func:`dask.optimization.cull`) then costs that block's tasks only, where
    culling the high-level graph again would walk every layer for every block.
    """

    dsk: dict[Any, Any]
    keys: list[Any]
    rows: list[int]
    retries: int = READ_RETRIES
    _graphs: dict[int, BlockGraph] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, parts: list[Any], rows: list[int], retries: int = READ_RETRIES) -> StreamSource:
        """The source of the delayed pairs ``parts`` (see :func:`~.pair_parts`)."""
        from dask.highlevelgraph import HighLevelGraph

        dsk = dict(HighLevelGraph.merge(*[p.dask for p in parts])) if parts else {}
        return cls(dsk, [p.key for p in parts], rows, retries)

    def graph(self, i: int) -> BlockGraph:
        """Block ``i``'s tasks."""
        graph = self._graphs.get(i)
        if graph is None:
            from dask.optimization import cull

            culled, _ = cull(self.dsk, [self.keys[i]])
            graph = self._graphs[i] = BlockGraph(culled, self.keys[i], index=i,
                                                 rows=self.rows[i], tries=self.retries + 1)
        return graph


def _fix(cause: BaseException) -> str:
    """The fix for a read error, by its cause (found where it happened: a cause does not travel
    back with the error Dask sends to the client)."""
    name = type(cause).__name__
    if isinstance(cause, ImportError):
        missing = getattr(cause, "name", None) or "the reader's package"
        return f"install {missing} on every worker (the same environment as the client's)"
    if isinstance(cause, FileNotFoundError):
        return ("the path must be readable at the same place from every worker: a shared file "
                "system, or an object-store URL (s3://, gs://) the workers can reach")
    if isinstance(cause, PermissionError) or "Credential" in name or "Access" in str(cause):
        return ("give the workers read access: credentials in their environment (e.g. "
                "AWS_ACCESS_KEY_ID), or storage_options= in the reader")
    return "make the data readable from every worker, or persist it (data='persist')"
