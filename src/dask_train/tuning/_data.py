"""The search's data, persisted on the cluster once and shared by every trial."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import dask
import dask.array as da
import numpy as np
from distributed import Client, Future, futures_of

from dask_train.data._inputs import to_numpy, writable
from dask_train.data._training import TrainingData
from dask_train.runtime._calls import live_workers

logger = logging.getLogger(__name__)

#: In-memory search data up to this many bytes goes to the cluster inside tasks (see
#: :class:`Resendable`); larger data is scattered, and sent again when its worker is lost.
EMBED_SEARCH_BYTES = 64 << 20


@dataclass
class SearchData:
    """Training data on the cluster (dask arrays whose blocks are in memory) and the validation
    data in the client (numpy: the scorer of every trial holds it).

    In-memory data scattered to the workers (beyond :data:`EMBED_SEARCH_BYTES`) cannot be
    recomputed by Dask: ``parts`` keeps it in the client, and :meth:`refresh` (before each
    trial) sends again the parts a lost worker took and rebuilds ``X`` and ``y`` from them.
    """

    X: da.Array
    y: da.Array
    validation: tuple[np.ndarray, np.ndarray]
    held: list[Any] = field(default_factory=list)
    parts: list[Resendable] = field(default_factory=list)

    def release(self) -> None:
        """Let the cluster forget the persisted blocks."""
        self.held.clear()
        self.parts.clear()

    def refresh(self) -> bool:
        """Send again from the client what a lost worker took (the scattered parts, and the
        blocks built on them), and rebuild ``X`` and ``y``; False when nothing was lost.

        A trial already running keeps the arrays it was given (its own blocks are persisted
        on its workers); the next trials get the new ones.
        """
        if not self.parts:
            return False
        blocks = [f for a in (self.X, self.y) for f in futures_of(a)]
        if all(p.whole() for p in self.parts) and all(
                f.status in ("finished", "pending") for f in blocks):
            return False
        self.X, self.y = _persisted(self.parts[0].client, self.parts)
        self.held = [self.X, self.y]
        logger.warning("the search's in-memory data lost a worker's share: sent it again from "
                       "the client (%d of %d parts)", sum(p.sent > 1 for p in self.parts),
                       len(self.parts))
        return True


class Resendable:
    """A value the client put on the cluster and can put there again: inside a task up to
    :data:`EMBED_SEARCH_BYTES` (a graph key Dask recomputes when its worker dies), scattered
    straight to a worker beyond (one copy, never through the scheduler), and scattered again
    from the client's copy when that worker was lost.

    Why 64 MiB: a task's arguments travel through the scheduler, which keeps them for as long
    as the key lives; beyond some tens of MiB that is the scheduler's memory and a "Sending
    large graph" warning per search. Scattered data goes to its worker directly but dies with
    it ("lose scattered data, which can't be recovered").
    """

    def __init__(self, client: Client, value: Any, *, embed: bool | None = None) -> None:
        self.client, self.value, self.sent = client, value, 0
        parts = value if isinstance(value, (tuple, list)) else (value,)
        self.embedded = sum(getattr(a, "nbytes", 0) for a in parts) <= EMBED_SEARCH_BYTES \
            if embed is None else embed
        self._future = self._send()

    def _send(self) -> Future:
        self.sent += 1
        if self.embedded:
            return self.client.submit(_same, self.value, pure=False)
        [future] = self.client.scatter([self.value], direct=True, hash=False)
        return future

    def whole(self) -> bool:
        """Whether the cluster still holds it (or can compute it again)."""
        return self.embedded or self._future.status == "finished"

    def future(self) -> Future:
        """Its future on the cluster, sent again first if its worker was lost."""
        if not self.whole():
            self._future = self._send()
        return self._future


def prepare_data(X: Any, y: Any, validation: Any, *, client: Client) -> SearchData:
    """Persist X and y once: dask collections are persisted where they are computed; in-memory
    arrays go block by block as :class:`Resendable` parts (recomputed by Dask up to
    :data:`EMBED_SEARCH_BYTES`, sent again by the client beyond)."""
    # Several inputs or targets (a dict or tuple of arrays) are one array of records, as in fit.
    Xv, yv = (writable(to_numpy(part, name=name))
              for part, name in zip(validation, ("X_val", "y_val")))
    data = TrainingData.of(X, y)  # as a fit reads them: xarray, frames, several inputs
    if not data.in_memory:
        # Under keys of its own: persisting the user's collection itself would keep its keys in
        # memory, and a later graph of the user's that rewrites them (dask's slicing optimisation
        # does) would meet "different run_spec for the same key" at the scheduler.
        token = uuid.uuid4().hex[:8]
        Xd, yd = (_renamed(part, f"dt-search-{name}-{token}")
                  for part, name in ((data.X, "X"), (data.y, "y")))
        Xd, yd = client.persist([Xd, yd])
        return SearchData(Xd, yd, (Xv, yv), held=[Xd, yd])
    Xa, ya = to_numpy(X, name="X"), to_numpy(y, name="y")
    workers = max(1, len(live_workers(client)))
    rows = max(1, -(-len(Xa) // (2 * workers)))  # two blocks per worker
    bounds = list(range(0, len(Xa), rows)) + [len(Xa)]
    # The whole data set goes one way: through the scheduler (one copy) up to the limit.
    embed = Xa.nbytes + ya.nbytes <= EMBED_SEARCH_BYTES
    parts = [Resendable(client, (Xa[a:b], ya[a:b]), embed=embed)
             for a, b in zip(bounds[:-1], bounds[1:])]
    Xd, yd = _persisted(client, parts)
    return SearchData(Xd, yd, (Xv, yv), held=[Xd, yd], parts=[] if embed else parts)


def _persisted(client: Client, parts: list[Resendable]) -> tuple[da.Array, da.Array]:
    """X and y as dask arrays whose blocks are the parts' (sent again when lost), persisted
    under new keys."""
    futures = [p.future() for p in parts]
    rows = [len(p.value[0]) for p in parts]
    x0, y0 = parts[0].value
    Xd = _concat(futures, 0, rows, x0.shape[1:], x0.dtype)
    yd = _concat(futures, 1, rows, y0.shape[1:], y0.dtype)
    Xd, yd = client.persist([Xd, yd])
    return Xd, yd


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


def on_cluster(client: Client, value: Any) -> Resendable:
    """``value`` (numpy arrays, a tuple of them) on the cluster for every trial to take (its
    :meth:`Resendable.future`): recomputed by Dask up to :data:`EMBED_SEARCH_BYTES`, sent
    again from the client beyond when the worker holding it was lost."""
    return Resendable(client, value)
