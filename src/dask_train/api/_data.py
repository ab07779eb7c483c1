"""The data a fit is given, made ready: the training blocks (scattered, persisted or streamed),
validation sets in memory or spread over the cluster."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from distributed import Client

from dask_train.data._block_graph import StreamSource
from dask_train.data._blocks import (
    BlockSet,
    SpreadValidation,
    as_dask_array,
    pair_parts,
    persist_blocks,
    persist_pairs,
    scatter_blocks,
)
from dask_train.data._cluster import live_workers
from dask_train.data._inputs import cast_floats, is_lazy, to_numpy
from dask_train.data._stream import data_nbytes, graph_bytes, stream_blocks
from dask_train.policy._data_mode import choose_data_mode
from dask_train.policy._scope import in_scope

logger = logging.getLogger(__name__)


def _is_dask(part: Any) -> bool:
    return hasattr(part, "dask") and hasattr(part, "compute")


def materialize(validation: Any, dtype: Any = np.float32, *, keep_dask: bool = False) -> Any:
    """Validation data as numpy, or (``keep_dask``) dask arrays left on the cluster.

    Several inputs or targets (a dict or tuple of arrays) become one array of records, as ``X``
    and ``y`` do. Floating inputs take ``dtype`` (the model's parameters'); integer inputs
    (token ids) are kept as they are. Anything that is not a pair is returned unchanged for the
    checks to name.
    """
    if validation is None or not isinstance(validation, (tuple, list)) or len(validation) != 2:
        return validation
    names = ("X_val", "y_val")
    if keep_dask and any(is_lazy(part) for part in validation):
        xv, yv = (as_dask_array(part, name=n) for part, n in zip(validation, names))
        return cast_floats(xv, dtype), yv
    x_np, y_np = (np.ascontiguousarray(to_numpy(part, name=n))
                  for part, n in zip(validation, names))
    return cast_floats(x_np, dtype), y_np


def spread_validation(client: Client, validation: Any) -> SpreadValidation | None:
    """Persist a dask validation pair as co-located blocks spread over the workers; None for a
    validation set in memory (or none)."""
    if validation is None or not any(_is_dask(part) for part in validation):
        return None
    xv, yv = validation
    futures = client.sync(persist_pairs, client, xv, yv)
    return SpreadValidation(futures, int(xv.shape[0]))


def training_blocks(client: Client, X: Any, y: Any, *, weights: Any, local: Any, mode: str,
                    labels: bool, timeout: float) -> BlockSet:
    """The blocks a torch fit trains on: in-memory input scattered in blocks, a dask collection
    persisted or streamed from storage each epoch (``fit(data=mode)``, see
    :func:`~dask_train.policy._data_mode.choose_data_mode`; ``auto`` logs its choice with the
    numbers). ``labels``: compute the labels' range (classification); ``timeout``: for the
    streamed data's read check on every worker."""
    if local is not None:
        x_np, y_np, w_np = (None if a is None else to_numpy(a, name=n)
                            for a, n in zip(local, ("X", "y", "sample_weight")))
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
