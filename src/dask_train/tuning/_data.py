"""The search's data, persisted on the cluster once and shared by every trial."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import dask
import dask.array as da
import numpy as np
from distributed import Client, Future

from dask_train.data._blocks import as_dask_array
from dask_train.data._inputs import is_lazy, to_numpy
from dask_train.runtime._calls import live_workers

#: In-memory search data up to this many bytes goes to the cluster inside tasks (see
#: prepare_data); larger data is scattered.
EMBED_SEARCH_BYTES = 64 << 20


@dataclass
class SearchData:
    """Training data on the cluster (dask arrays whose blocks are in memory) and the validation
    data in the client (numpy: the scorer of every trial holds it)."""

    X: da.Array
    y: da.Array
    validation: tuple[np.ndarray, np.ndarray]
    held: list[Any] = field(default_factory=list)

    def release(self) -> None:
        """Let the cluster forget the persisted blocks."""
        self.held.clear()


def prepare_data(X: Any, y: Any, validation: Any, *, client: Client) -> SearchData:
    """Persist X and y once: dask collections are persisted where they are computed; in-memory
    arrays go block by block inside tasks (recomputable when a worker dies) up to
    :data:`EMBED_SEARCH_BYTES`, and are scattered straight to the workers beyond it."""
    # Several inputs or targets (a dict or tuple of arrays) are one array of records, as in fit.
    Xv, yv = (np.ascontiguousarray(to_numpy(part, name=name))
              for part, name in zip(validation, ("X_val", "y_val")))
    if is_lazy(X) and is_lazy(y):
        # Under keys of its own: persisting the user's collection itself would keep its keys in
        # memory, and a later graph of the user's that rewrites them (dask's slicing optimisation
        # does) would meet "different run_spec for the same key" at the scheduler.
        token = uuid.uuid4().hex[:8]
        Xd, yd = (_renamed(as_dask_array(part, name=name), f"dt-search-{name}-{token}")
                  for part, name in ((X, "X"), (y, "y")))
        Xd, yd = client.persist([Xd, yd])
        return SearchData(Xd, yd, (Xv, yv), held=[Xd, yd])
    Xa, ya = to_numpy(X, name="X"), to_numpy(y, name="y")
    workers = max(1, len(live_workers(client)))
    rows = max(1, -(-len(Xa) // (2 * workers)))  # two blocks per worker
    bounds = list(range(0, len(Xa), rows)) + [len(Xa)]
    parts = [(Xa[a:b], ya[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    if Xa.nbytes + ya.nbytes <= EMBED_SEARCH_BYTES:
        # Inside tasks: graph keys Dask recomputes when a worker dies, so a lost worker fails at
        # most the trials that ran on it (scattered data dies with its worker and fails every
        # trial that reads it). One copy passes through the scheduler.
        futures = [on_cluster(client, part) for part in parts]
    else:
        # Larger: scattered straight to the workers, never through the scheduler.
        futures = client.scatter(parts, direct=True, hash=False)
    Xd = _concat([f for f in futures], 0, [b - a for a, b in zip(bounds[:-1], bounds[1:])],
                 Xa.shape[1:], Xa.dtype)
    yd = _concat([f for f in futures], 1, [b - a for a, b in zip(bounds[:-1], bounds[1:])],
                 ya.shape[1:], ya.dtype)
    Xd, yd = client.persist([Xd, yd])
    return SearchData(Xd, yd, (Xv, yv), held=[Xd, yd, futures])


def _same(block: np.ndarray) -> np.ndarray:
    return block


def _renamed(array: da.Array, name: str) -> da.Array:
    """``array`` under new keys; each block the same object as the source's (no copy)."""
    renamed: da.Array = da.map_blocks(_same, array, dtype=array.dtype, name=name)
    return renamed


def _part(pair: tuple[np.ndarray, np.ndarray], index: int) -> np.ndarray:
    return pair[index]


def _concat(futures: list[Future], index: int, rows: list[int], tail: tuple[int, ...],
            dtype: Any) -> da.Array:
    blocks = [da.from_delayed(dask.delayed(_part)(f, index), shape=(n, *tail), dtype=dtype)
              for f, n in zip(futures, rows)]
    return da.concatenate(blocks) if blocks else da.empty((0, *tail), dtype=dtype)


def on_cluster(client: Client, value: Any) -> Future:
    """``value`` (numpy arrays, a tuple of them) on the cluster for every trial to take: inside
    a task up to :data:`EMBED_SEARCH_BYTES`, a graph key Dask recomputes when the worker holding
    it dies (a scattered copy dies with it and fails every later trial); scattered beyond."""
    parts = value if isinstance(value, (tuple, list)) else (value,)
    if sum(getattr(a, "nbytes", 0) for a in parts) <= EMBED_SEARCH_BYTES:
        return client.submit(_same, value, pure=False)
    [future] = client.scatter([value], direct=True, hash=False)
    return future
