"""A Hugging Face ``datasets.Dataset`` as ``dt.run`` training data, read on the workers
(:func:`from_dataset`). In the client, beside the script's own ``datasets``: it imports neither
torch nor transformers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dask_train.errors import InvalidInput


def from_dataset(ds: Any, *, labels: str | None = "label", inputs: Sequence[str] | None = None,
                 rows_per_block: int | None = None) -> tuple[Any, Any]:
    """A Hugging Face ``datasets.Dataset`` as ``dt.run`` training data: ``(X, y)`` dask arrays
    whose blocks are read on the workers.

    A dataset on disk (``load_dataset``, ``load_from_disk``: memory-mapped Arrow files) travels
    to each block's task as its file paths and is read there; an in-memory one travels in pieces,
    each block's task holding an Arrow table of its rows. Columns must be fixed-width (a
    tokenizer's ``padding="max_length"``). ``dt.run(data={"train": ds})`` takes a Dataset as it
    is, every column by name (read the same way); this is for ``(X, y)`` of chosen columns.

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
    from dask_train.data._hf_datasets import columns, kind_of

    kind = kind_of(ds)
    if kind != "Dataset":
        raise InvalidInput([f"from_dataset(ds={type(ds).__name__}): pass a datasets.Dataset "
                            "(an IterableDataset streams without rows known: save it first)."])
    names = list(inputs) if inputs is not None else [c for c in ds.column_names if c != labels]
    if not names:
        raise InvalidInput([f"from_dataset: no input columns besides labels={labels!r} among "
                            f"the dataset's columns {ds.column_names}: name them, inputs=[...]."])
    wanted = names + ([labels] if labels is not None else [])
    arrays = columns(ds, name="from_dataset", columns=wanted, rows_per_block=rows_per_block)
    X = arrays[names[0]] if len(names) == 1 else {c: arrays[c] for c in names}
    return X, (arrays[labels] if labels is not None else None)
