"""``dt.run``'s named data sets: each Hugging Face set read as its columns, the sets after the
first whole in memory (every rank gets them), and the first as the blocks the ranks stream."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dask_train.data._blocks import BlockSet
from dask_train.data._hf_datasets import as_arrays, kind_of
from dask_train.data._inputs import writable
from dask_train.data._training import TrainingData
from dask_train.errors import InvalidInput

if TYPE_CHECKING:
    from distributed import Client

#: Named data sets besides the streamed one go to every rank whole, inside its task, up to this.
SMALL_BYTES = 64 << 20


def data_sets(data: Any) -> Any:
    """``data=`` with each Hugging Face ``datasets.Dataset`` as its columns, one dask array of
    records read in blocks on the workers (:func:`~dask_train.data._hf_datasets.as_arrays`):
    from here on it is several inputs like any other, for the checks, the small sets and the
    streamed set alike. The first, the set the ranks stream, becomes its
    :class:`~dask_train.data._training.TrainingData` here, once, for the checks and the blocks.
    A value that cannot be read so is kept as given, for
    :func:`~dask_train.api._run_checks.check_data_sets` to name its problems."""
    if not isinstance(data, Mapping) or kind_of(data) is not None:
        return data
    sets: dict[Any, Any] = {}
    for name, value in data.items():
        sets[name] = value
        try:
            sets[name] = value = as_arrays(value, name=f"data[{name!r}]")
            pair = isinstance(value, tuple) and len(value) == 2
            if len(sets) == 1 and (pair or not isinstance(value, (tuple, list))):
                x, y = value if pair else (value, None)
                sets[name] = TrainingData.of(x, y, name=f"data[{name!r}] X")
        except InvalidInput:
            pass  # kept as read so far, for the checks to name its problems
    return sets


def small_sets(data: Mapping[str, Any] | None) -> dict[str, Any]:
    """The named sets after the first, in memory (every rank gets them whole)."""
    if not data:
        return {}
    from dask_train.data._inputs import as_records, is_collection

    out: dict[str, Any] = {}
    problems = []
    for name, value in list(data.items())[1:]:
        x, y = value if isinstance(value, tuple) else (value, None)
        parts: list[Any] = []
        for part in (x, y):
            if part is None:
                parts.append(None)
                continue
            part = as_records(part) if isinstance(part, Mapping) else part
            nbytes = getattr(part, "nbytes", 0)
            if nbytes and nbytes > SMALL_BYTES:
                problems.append(f"data[{name!r}] is {nbytes / 2**20:.0f} MiB: the sets after the "
                                f"first travel whole to every rank (at most {SMALL_BYTES >> 20} "
                                "MiB); stream it as the first, or evaluate on a sample.")
                break
            parts.append(writable(part.compute() if is_collection(part) else part))
        else:
            out[name] = tuple(parts)
    if problems:
        raise InvalidInput(problems)
    return out


def streamed(client: Client, data: Mapping[str, Any] | None, *, ranks: int, mode: str = "auto",
            timeout: float = 120.0, written: list[int] | None = None,
            ) -> tuple[BlockSet, bool, str | None]:
    """The streamed data set's blocks, whether it has targets, and its name: sent in blocks
    when in memory, persisted on the workers, or read from storage each epoch (``mode``, as
    ``Trainer.fit(data=...)``). A dask collection is cut into the blocks ``written`` (the rows
    of each block a resumed checkpoint's ledger was written for) when it has as many rows,
    whatever cut its job chose for its ranks; else into at least two blocks a rank."""
    if not data:
        return BlockSet([], []), False, None
    name, train = next(iter(data.items()))  # a TrainingData since data_sets
    labels = train.y is not None
    train = train.with_targets()
    if not train.in_memory:
        as_written = None if written is None else train.with_row_blocks(written)
        train = as_written if as_written is not None else train.with_blocks_for(ranks)
    blocks = train.blocks(client, mode=mode, labels=False, timeout=timeout)
    return blocks, labels, name
