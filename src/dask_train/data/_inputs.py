"""Several inputs (or targets) per row, kept as one record array.

``X`` may be a dict of arrays with the same rows (dask or numpy arrays, or a dask DataFrame's
column groups such as ``{"cat": df[cats], "num": df[nums]}``), passed to ``forward(**batch)``,
or a tuple of them (``X=(tokens, mask)``), passed to ``forward(*batch)``. ``y`` may be a dict
too (a model with two heads), which a loss function of yours reads by name.

dask-train keeps such data as one numpy *record array* per block: one field per input, each
field of any shape and dtype. A record array is an ordinary ndarray of rows, so the whole data
path -- blocks persisted where they live, the ledger, the feed queues, shuffled minibatches,
exactly-once reading, resume -- works on it unchanged; only the model's call unpacks a batch
into its fields (:func:`dask_train.models._torch.model_inputs`). A tuple's inputs are the fields
``"*0"``, ``"*1"``, ...: names that are no Python identifier, so they can never be a keyword
argument of ``forward`` and the prefix alone says "positional".

Examples
--------
>>> import numpy as np
>>> x = pack({"cat": np.array([[1, 2], [3, 4]]), "num": np.array([0.5, 1.5], dtype="float32")})
>>> x.shape, x.dtype.names, x[1]["cat"].tolist()
((2,), ('cat', 'num'), [3, 4])
>>> sorted(unpack(x[[1, 0]]))
['cat', 'num']
>>> pack(named((np.zeros(2), np.ones(2)))).dtype.names
('*0', '*1')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dask_train.errors import InvalidInput

#: The field-name prefix of a positional input: ``X=(a, b)`` is kept as fields ``"*0"``, ``"*1"``.
POSITIONAL = "*"


def is_collection(x: Any) -> bool:
    """Whether ``x`` is one dask collection (an array, a DataFrame, a Series, a dask-backed
    xarray object): the one answer to "is this lazy" everywhere in dask-train."""
    import dask

    return dask.is_dask_collection(x)


def is_several(X: Any) -> bool:
    """Whether ``X`` holds several inputs: a dict, a tuple of arrays, or a list of dask
    collections (a list or tuple of numbers or of rows stays one array, as numpy reads it)."""
    if isinstance(X, Mapping):
        return True
    if isinstance(X, tuple):
        return len(X) > 0 and all(hasattr(a, "shape") or is_collection(a) for a in X)
    return isinstance(X, list) and len(X) > 0 and all(is_collection(a) for a in X)


def is_lazy(X: Any) -> bool:
    """Whether ``X`` is a dask collection, or several inputs of which one is."""
    if is_several(X):
        return any(is_collection(a) for a in (X.values() if isinstance(X, Mapping) else X))
    return is_collection(X)


def named(X: Any) -> dict[str, Any]:
    """Several inputs by field name: a dict's keys, or ``"*0"``, ``"*1"``... for a tuple's."""
    if isinstance(X, Mapping):
        return {str(k): v for k, v in X.items()}
    return {f"{POSITIONAL}{i}": v for i, v in enumerate(X)}


def label(field: str, name: str = "X") -> str:
    """How a message names one input: ``X['cat']`` or ``X[0]``."""
    if field.startswith(POSITIONAL) and field[1:].isdigit():
        return f"{name}[{field[1:]}]"
    return f"{name}[{field!r}]"


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


def cast_floats(x: Any, dtype: Any) -> Any:
    """``x`` (numpy or dask) with its floating data in ``dtype``: a plain floating array, or the
    floating fields of a record array; integer data (token ids, categories) is kept."""
    fields = getattr(x.dtype, "names", None)
    if fields is None:
        return x.astype(dtype) if x.dtype.kind == "f" and x.dtype != dtype else x
    want = np.dtype([(n, np.dtype(dtype) if x.dtype[n].base.kind == "f" else x.dtype[n].base,
                      x.dtype[n].shape) for n in fields])
    return x if want == x.dtype else x.astype(want)


def _as_dask(value: Any) -> Any:
    """A dask array of one input: a dask array, a dask DataFrame's columns (a column group, with
    its partitions' lengths computed), or an in-memory array."""
    import dask.array as da

    to_dask_array = getattr(value, "to_dask_array", None)
    if callable(to_dask_array):
        return to_dask_array(lengths=True)
    return value if is_collection(value) else da.from_array(np.asarray(value))


def _pack_blocks(names: tuple[str, ...], *blocks: np.ndarray) -> np.ndarray:
    return pack(dict(zip(names, blocks)))


def _reserved(X: Any, name: str) -> list[str]:
    if not isinstance(X, Mapping):
        return []
    return [f"{name} has the key {str(k)!r}: keys starting with {POSITIONAL!r} are kept for a "
            f"tuple's inputs (forward(*batch)); rename it." for k in X
            if str(k).startswith(POSITIONAL)]


def input_problems(arrays: Mapping[str, Any], name: str = "X") -> list[str]:
    """Problems with several inputs (or targets) as dask arrays, by field name (see
    :func:`named`): unknown or different numbers of rows, inputs without rows. Nothing is
    computed."""
    problems = []
    lengths: dict[str, int] = {}
    for field, a in arrays.items():
        if getattr(a, "ndim", 0) < 1:
            problems.append(f"{label(field, name)} is a scalar: every input needs one row per "
                            "sample.")
        elif any(np.isnan(c) for c in a.chunks[0]):
            problems.append(f"{label(field, name)} has unknown chunk sizes: call "
                            f"compute_chunk_sizes() on it first, or build it from a dask DataFrame "
                            "with to_dask_array(lengths=True).")
        else:
            lengths[label(field, name)] = int(a.shape[0])
    if len(set(lengths.values())) > 1:
        problems.append(f"the inputs of {name} have different numbers of rows: {lengths}; every "
                        "input needs one row per sample (the same rows, in the same order).")
    return problems


def as_records(X: Any, *, name: str = "X") -> Any:
    """Several inputs (a dict or tuple of dask or numpy arrays) as one dask array of records, in
    the first input's row chunks; each block is packed where it is computed, never in the client.

    Raises
    ------
    InvalidInput
        For no inputs, reserved names, unknown or different numbers of rows; every problem at
        once, each naming the input.
    """
    import dask
    import dask.array as da

    if not X:
        raise InvalidInput([f"{name} is empty: give at least one input, e.g. {name}={{'x': {name}}}."])
    arrays = {k: _as_dask(v) for k, v in named(X).items()}
    problems = _reserved(X, name) + input_problems(arrays, name)
    if problems:
        raise InvalidInput(problems)
    chunks = next(iter(arrays.values())).chunks[0]
    # Rows in the first input's chunks, every other axis in one chunk: a block is whole rows.
    arrays = {k: a.rechunk({0: chunks, **{ax: -1 for ax in range(1, a.ndim)}})
              for k, a in arrays.items()}
    names, dtype = tuple(arrays), records_dtype(arrays)
    packed = [da.from_delayed(
        dask.delayed(_pack_blocks, pure=True)(names, *[a.blocks[i] for a in arrays.values()]),
        shape=(n,), dtype=dtype) for i, n in enumerate(chunks)]
    return da.concatenate(packed) if packed else da.empty((0,), dtype=dtype)


def writable(a: Any, dtype: Any = None) -> np.ndarray:
    """``a`` as a contiguous array (in ``dtype``) that may be written: itself when it is one,
    else one copy.

    pandas 3 hands out read-only views of its columns (``Series.to_numpy()``, a dask
    DataFrame's ``to_dask_array`` blocks), as ``np.load(mmap_mode="r")`` does, and distributed
    keeps the flag across the wire; a tensor made from such an array would share memory torch
    cannot protect (its "The given NumPy array is not writable" warning), so the copy is made
    once here, where the data enter, rather than for each batch.

    Examples
    --------
    >>> a = np.arange(3)
    >>> writable(a) is a
    True
    >>> a.flags.writeable = False
    >>> writable(a).flags.writeable
    True
    """
    out = np.ascontiguousarray(a, dtype=dtype)
    return out if out.flags.writeable else out.copy()


def to_numpy(part: Any, *, name: str = "X") -> Any:
    """``part`` in memory: several inputs packed as one record array (each computed), a dask
    collection computed, anything else as ``np.asarray`` reads it."""
    if is_several(part):
        if is_lazy(part):
            return np.asarray(as_records(part, name=name).compute())
        arrays = {k: np.asarray(v) for k, v in named(part).items()}
        rows = {label(k, name): len(a) if a.ndim else 0 for k, a in arrays.items()}
        problems = _reserved(part, name)
        if len(set(rows.values())) != 1:
            problems.append(f"the inputs of {name} have different numbers of rows: {rows}; "
                            "every input needs one row per sample.")
        if problems:
            raise InvalidInput(problems)
        return pack(arrays)
    return np.asarray(part.compute() if is_collection(part) else part)
