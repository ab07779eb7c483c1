"""A Hugging Face ``datasets.Dataset`` as training data: its rows cut into blocks (row ranges),
each block read on a worker, every column one named array of the block.

``dt.run(data={"train": ds})`` (:func:`as_arrays`) and ``dt.huggingface.from_dataset`` both come
here, so a Dataset is read one way whichever door it came through: in row blocks, each block one
task that reads every column of its rows where it is computed. ``dt.run`` takes its columns as
one dask array of records (:func:`records`: what a dict of arrays becomes,
:mod:`dask_train.data._inputs`), so from there it is several inputs like any other: persisted or
streamed, in the ledger, read by ``ctx.batches`` as ``{"input_ids": ..., "labels": ...}``;
``from_dataset`` takes them as dask arrays by column (:func:`columns`).

* A Dataset on disk (``load_from_disk``, ``load_dataset``, ``Dataset.from_parquet``: memory-mapped
  Arrow files, ``ds.cache_files``) travels to each block's task as its files' paths (it pickles
  so) and the task reads its row range from them: the graph holds no rows, and the workers must
  see the files (one host, or a shared file system).
* An in-memory Dataset (``Dataset.from_dict``, ``from_pandas``) has no file a worker could read:
  each block's rows travel inside its task as an Arrow table of those rows only (a slice of the
  whole table would pickle the whole table's buffers) and become arrays on the worker: in pieces,
  never whole, and never as arrays in this process.

``datasets`` itself is never imported here: its objects are recognised through ``sys.modules``
(a process that made one has imported it), so ``import dask_train`` costs nothing more.
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dask_train.errors import InvalidInput

logger = logging.getLogger(__name__)

#: The ``datasets`` classes a value is recognised as, by name.
_KINDS = ("Dataset", "DatasetDict", "IterableDataset", "IterableDatasetDict")


def kind_of(obj: Any) -> str | None:
    """The name of ``obj``'s ``datasets`` class (``"Dataset"``, ``"DatasetDict"``,
    ``"IterableDataset"``, ``"IterableDatasetDict"``), None for anything else. Never imports
    ``datasets``: where it was not imported, no object of it exists."""
    datasets = sys.modules.get("datasets")
    if datasets is None:
        return None
    for name in _KINDS:
        cls = getattr(datasets, name, None)
        if isinstance(cls, type) and isinstance(obj, cls):
            return name
    return None


def as_arrays(value: Any, *, name: str) -> Any:
    """``value``, a data set of ``dt.run(data=)``, as the rest of the job reads it: a
    ``datasets.Dataset`` as its columns, one dask array of records (:func:`records`: what
    ``{column: array}`` becomes; the targets a column among the others, as HF's models take
    them), anything else as it is.

    Raises
    ------
    InvalidInput
        For a ``DatasetDict``, an ``IterableDataset``, a Dataset with separate targets, and
        columns that cannot become arrays: every problem at once, each naming ``name``.
    """
    pair = isinstance(value, tuple) and len(value) == 2
    x, y = value if pair else (value, None)
    kind, y_kind = kind_of(x), kind_of(y)
    if kind is None and y_kind is None:
        return value
    if kind not in (None, "Dataset"):
        raise InvalidInput([_wrong_kind(x, kind, name)])
    if pair:
        shown = ", ".join(f"datasets.{k}" if k else type(v).__name__
                          for k, v in ((kind, x), (y_kind, y)))
        raise InvalidInput([f"{name} is ({shown}): a datasets.Dataset holds its targets as a "
                            f"column; pass the Dataset alone as {name}, its targets a column of "
                            "it (ds.add_column('labels', y))."])
    return records(x, name=name)


def _wrong_kind(x: Any, kind: str, name: str) -> str:
    if kind.endswith("Dict"):
        splits = list(x)
        first = splits[0] if splits else "train"
        return (f"{name} is a datasets.{kind} of the splits {splits}: pass one split as one "
                f"data set, e.g. dt.run(data={{'train': dd[{first!r}]}}), another split as a "
                "second named set for evaluation.")
    return (f"{name} is a datasets.{kind}, a stream whose rows are not known ahead: dt.run cuts "
            "a Dataset's rows into blocks read on the workers, each once per epoch; load it "
            "without streaming=True, or write its rows once "
            "(datasets.Dataset.from_generator, then save_to_disk) and pass that Dataset.")


def columns(ds: Any, *, name: str, columns: Sequence[str] | None = None,
            rows_per_block: int | None = None) -> dict[str, Any]:
    """The ``columns`` of the ``datasets.Dataset`` ``ds`` (every column by default) as dask
    arrays in the same row blocks, each block's columns read by one task on the worker that
    computes it (``dt.huggingface.from_dataset``'s inputs and targets).

    Errors call the Dataset ``name``. Nothing is read in this process but one row (each column's
    dtype and per-row shape) and the list columns' offsets (every row the same length?).

    Raises
    ------
    InvalidInput
        For missing columns, no rows, text or other columns that cannot become arrays, rows of
        different lengths, missing values: every problem at once.
    """
    import dask.array as da

    wanted = list(ds.column_names if columns is None else columns)
    first, blocks = _blocks(ds, wanted, name=name, rows_per_block=rows_per_block, packed=False)
    return {c: da.concatenate([da.from_delayed(block[c], shape=(rows,) + first[c].shape[1:],
                                               dtype=first[c].dtype) for block, rows in blocks])
            for c in wanted}


def records(ds: Any, *, name: str, rows_per_block: int | None = None) -> Any:
    """Every column of the ``datasets.Dataset`` ``ds`` as one dask array of records (a field per
    column, :mod:`dask_train.data._inputs`): what a dict of its columns becomes, each block read
    and packed by one task on the worker that computes it. Raises as :func:`columns`."""
    import dask.array as da

    from dask_train.data._inputs import records_dtype

    wanted = list(ds.column_names)
    first, blocks = _blocks(ds, wanted, name=name, rows_per_block=rows_per_block, packed=True)
    dtype = records_dtype(first)
    return da.concatenate([da.from_delayed(block, shape=(rows,), dtype=dtype)
                           for block, rows in blocks])


def _blocks(ds: Any, wanted: list[str], *, name: str, rows_per_block: int | None,
            packed: bool) -> tuple[dict[str, np.ndarray], list[tuple[Any, int]]]:
    """``wanted``'s first row, and one delayed read per block with its rows."""
    import dask
    from dask.base import tokenize

    _check(ds, wanted, name=name)
    n = len(ds)
    first = read_rows(ds, 0, 1, wanted)
    odd = [c for c, a in first.items() if a.dtype == object]
    if odd:
        raise InvalidInput([f"{name}: the columns {odd} hold nested rows of different lengths; "
                            "pad them so that each row is an array of one shape."])
    step = int(rows_per_block or block_rows(first, n))
    on_disk = _on_disk(ds)
    logger.info("%s: %d rows in blocks of %d, read on the workers %s", name, n, step,
                "from its Arrow files" if on_disk else "from Arrow tables of each block's rows")
    # Named by the dataset's fingerprint (its content) and the columns read: the same blocks
    # again, in this job or a later one, are the same keys.
    key = (f"dt-hf-{getattr(ds, '_fingerprint', None) or uuid.uuid4().hex}-"
           f"{tokenize(wanted, packed)}")
    read = dask.delayed(read_rows, pure=True)
    blocks = []
    for start in range(0, n, step):
        stop = min(n, start + step)
        if on_disk:
            # The dataset pickles as its Arrow files' paths (memory-mapped tables): the task
            # holds no rows and reads its range where it runs.
            block = read(ds, start, stop, wanted, packed, dask_key_name=f"{key}-{start}-{stop}")
        else:
            block = read(_rows_table(ds, start, stop, wanted), 0, stop - start, wanted, packed,
                         dask_key_name=f"{key}-{start}-{stop}")
        blocks.append((block, stop - start))
    return first, blocks


def _check(ds: Any, wanted: list[str], *, name: str) -> None:
    """Raise every problem with reading ``wanted`` of ``ds`` as arrays (from its schema and
    its list columns' offsets only)."""
    missing = [c for c in wanted if c not in ds.column_names]
    problems = []
    if missing or not wanted:
        problems.append(f"{name}: the columns {missing or wanted} are not in the dataset's "
                        f"columns {ds.column_names}.")
    if len(ds) == 0:
        problems.append(f"{name} has no rows: pass a Dataset with rows.")
    if problems:
        raise InvalidInput(problems)
    schema = ds.data.schema
    other = {c: str(schema.field(c).type) for c in wanted if not _numeric(schema.field(c).type)}
    if other:
        listed = ", ".join(f"{c!r} ({t})" for c, t in other.items())
        problems.append(f"{name}: the columns {listed} cannot become arrays of numbers: drop "
                        f"them, ds = ds.remove_columns({list(other)}) (or keep the model's "
                        "columns, ds.select_columns([...])), or turn them into numbers first "
                        "(a tokenizer's ds.map for text, ds.cast_column for booleans).")
    numeric = [c for c in wanted if c not in other]
    nulls = [c for c in numeric if ds.data.column(c).null_count]
    if nulls:
        problems.append(f"{name}: the columns {nulls} have missing values (None): fill them "
                        "(ds.map) or drop those rows (ds.filter).")
    ragged = _ragged(ds, [c for c in numeric if c not in nulls])
    if ragged:
        problems.append(f"{name}: the columns {ragged} hold rows of different lengths; pad them "
                        "(a tokenizer's padding='max_length') so each is an array.")
    if problems:
        raise InvalidInput(problems)


def _numeric(t: Any) -> bool:
    """Whether an Arrow type holds numbers, alone or in (nested, fixed or not) lists: what becomes
    a numeric array of the rows."""
    import pyarrow as pa

    while True:
        if isinstance(t, pa.ExtensionType):  # datasets' Array2D..Array5D
            t = t.storage_type
        elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            t = t.value_type
        else:
            return bool(pa.types.is_integer(t) or pa.types.is_floating(t))


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


def _on_disk(ds: Any) -> bool:
    """Whether every part of ``ds`` (its table and its indices mapping, after ``select`` or
    ``shuffle``) is a memory-mapped Arrow file: then it pickles as paths, and a worker reads it
    from there. A table with a part in memory (``ds.map(keep_in_memory=True)``, an in-memory
    Dataset concatenated to one on disk) would carry that part in every block's task."""
    if not ds.cache_files:
        return False
    from datasets.table import ConcatenationTable, MemoryMappedTable

    def mapped(table: Any) -> bool:
        if isinstance(table, ConcatenationTable):
            return all(mapped(t) for row in table.blocks for t in row)
        return isinstance(table, MemoryMappedTable)

    indices = getattr(ds, "_indices", None)
    return mapped(ds.data) and (indices is None or mapped(indices))


def _rows_table(ds: Any, start: int, stop: int, columns: Sequence[str]) -> Any:
    """Rows ``start:stop`` of an in-memory ``ds`` as an Arrow table holding those rows only
    (``take`` copies them out: a slice pickles with its parent's whole buffers); the schema's
    metadata keeps the columns' features (a ``ClassLabel``, an ``Array2D``)."""
    import pyarrow as pa

    table = ds.with_format("arrow", columns=list(columns))[start:stop]
    return table.take(pa.array(np.arange(table.num_rows)))


def read_rows(ds: Any, start: int, stop: int, columns: Sequence[str],
              packed: bool = False) -> Any:
    """Rows ``start:stop`` of ``columns`` of ``ds`` (a Dataset, or an Arrow table of a block's
    rows) as numpy arrays by column, as ``datasets`` formats them (a fixed-length list column as
    2-D); ``packed``: as one record array."""
    if not hasattr(ds, "with_format"):
        from datasets.arrow_dataset import Dataset
        from datasets.table import InMemoryTable

        # A fingerprint given: the default hashes the whole table.
        ds = Dataset(InMemoryTable(ds), fingerprint="dt-block")
    part = ds.with_format("numpy", columns=list(columns))[start:stop]
    arrays = {c: np.asarray(part[c]) for c in columns}
    if not packed:
        return arrays
    from dask_train.data._inputs import pack

    return pack(arrays)


def block_rows(first: Mapping[str, np.ndarray], n: int) -> int:
    """Rows per block: a sixteenth of the rows (enough blocks that dt.run need not split them
    again for a few ranks), at most about 16 MiB, rounded up to a multiple of 512 rows so that
    batches of any power of two up to 512 fill each block (``ctx.batches`` cuts each block's
    rows into batches: a block of 1,250 rows ends in a batch of 2 at 32 a batch)."""
    row_bytes = max(1, sum(a[0].nbytes for a in first.values()))
    rows = min(-(-n // 16), max(1, (16 << 20) // row_bytes))
    return int(min(n, -(-rows // 512) * 512))
