"""A Hugging Face ``datasets.Dataset`` as ``dt.run`` training data, read on the workers
(:func:`from_dataset`). In the client, beside the script's own ``datasets``: it imports neither
torch nor transformers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dask_train.errors import InvalidInput


def from_dataset(ds: Any, *, labels: str | None = "label", inputs: Sequence[str] | None = None,
                 rows_per_block: int | None = None) -> tuple[Any, Any]:
    """A Hugging Face ``datasets.Dataset`` as ``dt.run`` training data: ``(X, y)`` dask arrays
    whose blocks are read on the workers.

    A dataset on disk (``load_dataset``, ``load_from_disk``: memory-mapped Arrow files) travels
    to each block's task as its file paths and is read there; an in-memory one is converted in
    this process. Columns must be fixed-width (a tokenizer's ``padding="max_length"``).

    Parameters
    ----------
    ds : datasets.Dataset
    labels : str or None
        The targets' column (None: no targets).
    inputs : sequence of str, optional
        The input columns; every other column by default. One column gives ``X`` as an array
        (read as ``input_ids`` by :func:`dataset`), several a dict of arrays by name.
    rows_per_block : int, optional
        Rows per block; by default a sixteenth of the rows, at most about 16 MiB, a multiple of
        512.

    Examples
    --------
    >>> X, y = dt.huggingface.from_dataset(tokenized, inputs=["input_ids", "attention_mask"])
    >>> dt.run(train, data={"train": (X, y)})                                 # doctest: +SKIP
    """
    import dask
    import dask.array as da

    import datasets

    if not isinstance(ds, datasets.Dataset):
        raise InvalidInput([f"from_dataset(ds={type(ds).__name__}): pass a datasets.Dataset "
                            "(an IterableDataset streams without rows known: save it first)."])
    names = list(inputs) if inputs is not None else [c for c in ds.column_names if c != labels]
    wanted = names + ([labels] if labels is not None else [])
    missing = [c for c in wanted if c not in ds.column_names]
    if missing or not names:
        raise InvalidInput([f"from_dataset: columns {missing or names} are not in the dataset's "
                            f"columns {ds.column_names}."])
    n = len(ds)
    if n == 0:
        raise InvalidInput(["from_dataset: the dataset has no rows."])
    first = _read_rows(ds, 0, 1, wanted)
    ragged = _ragged(ds, wanted)
    if ragged:
        raise InvalidInput([f"from_dataset: columns {ragged} hold rows of different lengths; "
                            "pad them (a tokenizer's padding='max_length') so each is an array."])
    if not ds.cache_files:  # in memory: nothing on disk for a worker to read
        whole = _read_rows(ds, 0, n, wanted)
        arrays = {c: da.from_array(whole[c], chunks=(rows_per_block or
                                                    _block_rows(first, n),) + whole[c].shape[1:])
                  for c in wanted}
    else:
        step = rows_per_block or _block_rows(first, n)
        parts: dict[str, list[Any]] = {c: [] for c in wanted}
        read = dask.delayed(_read_rows, pure=True)
        for start in range(0, n, step):
            stop = min(n, start + step)
            # One task reads every column of a block where it is computed; the dataset pickles
            # as its Arrow files' paths (a memory-mapped table), not its rows.
            block = read(ds, start, stop, wanted,
                         dask_key_name=f"dt-hf-read-{ds._fingerprint}-{start}-{stop}")
            for c in wanted:
                shape = (stop - start,) + first[c].shape[1:]
                parts[c].append(da.from_delayed(block[c], shape=shape, dtype=first[c].dtype))
        arrays = {c: da.concatenate(parts[c]) for c in wanted}
    X = arrays[names[0]] if len(names) == 1 else {c: arrays[c] for c in names}
    return X, (arrays[labels] if labels is not None else None)


def _ragged(ds: Any, columns: Sequence[str]) -> list[str]:
    """The list columns whose rows differ in length (read from the Arrow offsets only)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out = []
    for c in columns:
        column = ds.data.column(c)
        while pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            lengths = pc.min_max(pc.list_value_length(column))
            if lengths["min"].as_py() != lengths["max"].as_py():
                out.append(c)
                break
            column = pc.list_flatten(column)
    return out


def _block_rows(first: Mapping[str, np.ndarray], n: int) -> int:
    """Rows per block: a sixteenth of the rows (enough blocks that dt.run need not split them
    again for a few ranks), at most about 16 MiB, rounded up to a multiple of 512 rows so that
    batches of any power of two up to 512 fill each block (``ctx.batches`` cuts each block's
    rows into batches: a block of 1,250 rows ends in a batch of 2 at 32 a batch)."""
    row_bytes = max(1, sum(a[0].nbytes for a in first.values()))
    rows = min(-(-n // 16), max(1, (16 << 20) // row_bytes))
    return int(min(n, -(-rows // 512) * 512))


def _read_rows(ds: Any, start: int, stop: int, columns: Sequence[str]) -> dict[str, np.ndarray]:
    """Rows ``start:stop`` of ``columns`` as numpy arrays."""
    part = ds.with_format("numpy", columns=list(columns))[start:stop]
    return {c: np.asarray(part[c]) for c in columns}
