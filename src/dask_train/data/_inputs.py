"""Several inputs per row: ``X`` as a dict of arrays with the same rows (dask or numpy arrays, or a
dask DataFrame's column groups such as ``{"cat": df[cats], "num": df[nums]}``), kept as one
record array.

A model with several inputs (a tabular model's categorical columns for its ``nn.Embedding`` s
and its numeric columns, say) takes ``forward(**batch)``. dask-train keeps such an ``X`` as one
numpy *record array* per block: one field per input, each field of any shape and dtype. A record
array is an ordinary ndarray of rows, so the whole data path -- blocks persisted where they
live, the ledger, the feed queues, shuffled minibatches, exactly-once reading, resume -- works on
it unchanged; only the model's call unpacks a batch into its fields
(:func:`dask_train.models._torch.model_inputs`).

Examples
--------
>>> import numpy as np
>>> x = pack({"cat": np.array([[1, 2], [3, 4]]), "num": np.array([0.5, 1.5], dtype="float32")})
>>> x.shape, x.dtype.names, x[1]["cat"].tolist()
((2,), ('cat', 'num'), [3, 4])
>>> sorted(unpack(x[[1, 0]]))
['cat', 'num']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def is_records(x: Any) -> bool:
    """Whether ``x`` (an array, numpy or dask) holds several inputs as record fields."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and dtype.names is not None


def records_dtype(arrays: Mapping[str, Any]) -> np.dtype:
    """The record dtype of one row of ``arrays`` (a field per input, with its per-row shape)."""
    return np.dtype([(str(name), np.dtype(a.dtype), tuple(a.shape[1:]))
                     for name, a in arrays.items()])


def pack(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """One record array from arrays with the same number of rows."""
    rows = {len(a) for a in arrays.values()}
    if len(rows) != 1:
        raise ValueError(f"the inputs have different numbers of rows: "
                         f"{ {k: len(a) for k, a in arrays.items()} }")
    out = np.empty(rows.pop(), dtype=records_dtype(arrays))
    for name, a in arrays.items():
        out[str(name)] = a
    return out


def unpack(x: np.ndarray) -> dict[str, np.ndarray]:
    """The inputs of a record array, each contiguous (a field of a record array is strided)."""
    assert x.dtype.names is not None
    return {name: np.ascontiguousarray(x[name]) for name in x.dtype.names}


def _as_dask(value: Any) -> Any:
    """A dask array of one input: a dask array, a dask DataFrame's columns (a column group, with
    its partitions' lengths computed), or an in-memory array."""
    import dask.array as da

    to_dask_array = getattr(value, "to_dask_array", None)
    if callable(to_dask_array):
        return to_dask_array(lengths=True)
    return value if hasattr(value, "dask") else da.from_array(np.asarray(value))


def _pack_blocks(names: tuple[str, ...], *blocks: np.ndarray) -> np.ndarray:
    return pack(dict(zip(names, blocks)))


def as_records(X: Mapping[str, Any]) -> Any:
    """A dict of dask (or numpy) arrays as one dask array of records, in the first input's row
    chunks; each block is packed where it is computed, never in the client.

    Raises
    ------
    ValueError
        For an empty dict, or inputs with different numbers of rows; the message names them.
    """
    import dask
    import dask.array as da

    if not X:
        raise ValueError("X is an empty dict: give at least one input, e.g. X={'x': X}.")
    arrays = {str(k): _as_dask(v) for k, v in X.items()}
    lengths = {k: a.shape[0] for k, a in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"the inputs of X have different numbers of rows: {lengths}; every "
                         "input needs one row per sample.")
    chunks = next(iter(arrays.values())).chunks[0]
    # Rows in the first input's chunks, every other axis in one chunk: a block is whole rows.
    arrays = {k: a.rechunk({0: chunks, **{ax: -1 for ax in range(1, a.ndim)}})
              for k, a in arrays.items()}
    names, dtype = tuple(arrays), records_dtype(arrays)
    packed = [da.from_delayed(
        dask.delayed(_pack_blocks, pure=True)(names, *[a.blocks[i] for a in arrays.values()]),
        shape=(n,), dtype=dtype) for i, n in enumerate(chunks)]
    return da.concatenate(packed) if packed else da.empty((0,), dtype=dtype)
