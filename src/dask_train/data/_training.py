"""The training data of a job, as one object made once from whatever the user passed.

``Trainer.fit`` and ``dt.run`` take dask arrays and DataFrames, dicts and tuples of them (several
inputs), xarray objects, numpy arrays, or data read from files. :meth:`TrainingData.of` turns any
of these into one :class:`TrainingData`: the inputs as one dask array (records for several
inputs), the targets and weights beside them, and, when nothing was lazy, the in-memory originals
(sent to the workers in blocks by scatter, never through the graph). From there, each job asks it
for its :class:`~dask_train.data._blocks.BlockSet` (persisted on the workers, or streamed from
storage each epoch): the same road for every job.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from dask_train.data._inputs import cast_floats, is_lazy, to_numpy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingData:
    """A job's training data: ``X`` (a dask array, records for several inputs), ``y`` and
    ``weights`` (dask arrays, or None), and ``local``: the in-memory ``(X, y, weights)`` as
    given when none of them is a dask collection (None otherwise)."""

    X: Any
    y: Any = None
    weights: Any = None
    local: tuple[Any, Any, Any] | None = None

    @classmethod
    def of(cls, X: Any, y: Any = None, *, sample_weight: Any = None,
           name: str = "X") -> TrainingData:
        """The training data of ``X`` (and ``y``, ``sample_weight``), in any form a job takes.

        An xarray object is cut into rows along its sample dimension (``y``'s, else its first),
        its other dimensions flattened into features (:mod:`dask_train.data._xarray`); errors
        call the inputs ``name``.

        Raises
        ------
        InvalidInput
            For inputs that cannot be read as arrays (each named).
        """
        from dask_train.data._blocks import as_dask_array
        from dask_train.data._xarray import from_xarray

        X, y = from_xarray(X, y, name=name)
        parts = (X, y, sample_weight)
        local = None if any(is_lazy(a) for a in parts if a is not None) else parts
        y_name = "y" if name == "X" else f"{name.removesuffix(' X')} y"
        return cls(X=as_dask_array(X, name=name),
                   y=None if y is None else as_dask_array(y, name=y_name),
                   weights=None if sample_weight is None else as_dask_array(sample_weight,
                                                                            name="sample_weight"),
                   local=local)

    @property
    def in_memory(self) -> bool:
        """Whether the data was given in memory (it is scattered, never read from storage)."""
        return self.local is not None

    @property
    def n_rows(self) -> int:
        """Training rows."""
        return int(self.X.shape[0])

    def cast(self, dtype: Any) -> TrainingData:
        """The data with its floating inputs in ``dtype`` (the model's parameters'); integer
        inputs (token ids) kept. Itself when nothing changes; lazy (a dask ``astype``)."""
        converted = cast_floats(self.X, dtype)
        if converted is self.X:
            return self
        return dataclasses.replace(self, X=converted)

    def with_targets(self) -> TrainingData:
        """The data with targets: zeros (int8) for data given without (``dt.run``'s
        ``data={"train": X}``), so that every block is a pair."""
        if self.y is not None:
            return self
        import dask.array as da

        y = da.zeros((self.n_rows,), chunks=(self.X.chunks[0],), dtype=np.int8)
        local = None if self.local is None else \
            (self.local[0], np.zeros(self.n_rows, dtype=np.int8), self.local[2])
        return dataclasses.replace(self, y=y, local=local)

    def with_blocks_for(self, readers: int) -> TrainingData:
        """The data in at least four row blocks per reader where it has fewer than two: a block
        is read by one reader per epoch, so with fewer blocks than readers some would get no
        share at all (``dt.run``'s ranks each read whole blocks)."""
        want = 4 * readers
        if self.X.numblocks[0] >= 2 * readers or self.n_rows < want:
            return self
        rows = -(-self.n_rows // want)
        logger.info("the training data has %d row blocks for %d ranks: rechunked to %d rows a "
                    "block", self.X.numblocks[0], readers, rows)
        return self._rechunked(rows)

    def with_row_blocks(self, rows: list[int]) -> TrainingData | None:
        """The data cut into blocks of ``rows`` rows each, in order (a checkpoint's blocks, see
        :func:`~dask_train.policy._ledger.written_rows`); None when it has another number of
        rows in all, so cannot be."""
        if sum(rows) != self.n_rows or not rows:
            return None
        if list(self.X.chunks[0]) == rows:
            return self
        logger.info("the training data is cut into the %d row blocks its checkpoint was written "
                    "for (it has %d)", len(rows), self.X.numblocks[0])
        return self._rechunked(tuple(rows))

    def _rechunked(self, rows: int | tuple[int, ...]) -> TrainingData:
        """X, y and the weights in row blocks of ``rows`` (dask's ``rechunk({0: rows})``)."""
        def cut(a: Any) -> Any:
            return None if a is None else a.rechunk({0: rows})

        return dataclasses.replace(self, X=cut(self.X), y=cut(self.y), weights=cut(self.weights))

    def blocks(self, client: Any, *, mode: str, labels: bool, timeout: float) -> Any:
        """The :class:`~dask_train.data._blocks.BlockSet` a job trains on: in-memory data
        scattered in blocks; a dask collection persisted, or streamed from storage each epoch
        (``mode``, see :func:`~dask_train.policy._data_mode.choose_data_mode`; ``"auto"`` logs
        its choice with the numbers). ``labels``: compute the labels' range (classification);
        ``timeout``: for the streamed data's read check on every worker."""
        from dask_train.data._block_graph import StreamSource
        from dask_train.data._blocks import pair_parts, persist_blocks, scatter_blocks
        from dask_train.data._cluster import live_workers
        from dask_train.data._stream import data_nbytes, graph_bytes, stream_blocks
        from dask_train.policy._data_mode import choose_data_mode
        from dask_train.policy._scope import in_scope

        X, y, weights = self.X, self.y, self.weights
        if self.local is not None:
            x_np, y_np, w_np = (None if a is None else to_numpy(a, name=n)
                                for a, n in zip(self.local, ("X", "y", "sample_weight")))
            blocks = client.sync(scatter_blocks, client, x_np, y_np, weights=w_np, dtype=X.dtype)
            blocks.note = "in memory: sent to the workers in blocks"
            return blocks
        source, why = None, f"data={mode!r}"
        if mode == "auto":
            rows = [int(r) for r in X.chunks[0]]
            source = StreamSource.of(pair_parts(X, y, weights=weights), rows)
            embedded = graph_bytes(source.graph(int(np.argmin(rows)))) if rows else 0
            limits = in_scope({a: int(w.get("memory_limit") or 0)
                               for a, w in live_workers(client).items()})
            mode, why = choose_data_mode(mode, nbytes=data_nbytes(X, y, weights),
                                         memory_limits=limits, graph_bytes=embedded)
            logger.info(why)
        if mode == "stream":
            blocks = client.sync(stream_blocks, client, X, y, weights=weights, labels=labels,
                                 timeout=timeout, source=source)
            blocks.note = f"streamed from storage every epoch ({why})"
        else:
            blocks = client.sync(persist_blocks, client, X, y, weights=weights)
            blocks.note = f"persisted on the workers ({why})"
        return blocks
