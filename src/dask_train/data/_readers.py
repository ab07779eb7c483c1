"""Reading training data on the workers, never through the client.

``da.from_array(np.load(path, mmap_mode="r"))``, the obvious way, puts the whole array into the
graph the scheduler receives (one 268 MiB key for the inflated digits) and leaves its blocks on
whichever worker happened to unpack it (20 of 22 on one of two workers, measured). Here each block
is one small task that opens the file memory-mapped on a worker and copies its own rows: the graph
holds file names and row numbers only, and the blocks are computed where they will be trained.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import dask
import numpy as np

from dask_train.errors import InvalidInput

if TYPE_CHECKING:
    import dask.array as da

#: Default block size: large enough that a task per block is cheap against the rows it carries
#: (a task costs ~10 ms of control), small enough to balance and to re-feed after a failure.
DEFAULT_BLOCK_BYTES = 64 * 2**20


def _read_rows(path: str, start: int, stop: int) -> np.ndarray:
    # A copy of the rows, not a view of the map: the block outlives the open file, and a
    # contiguous array is what the feed slices into batches.
    return np.array(np.load(path, mmap_mode="r")[start:stop])


def from_npy(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
             block_rows: int | None = None) -> da.Array:
    """A dask array over one or more ``.npy`` files, read by the workers block by block.

    Several files are concatenated along the first axis (their other dimensions and dtype must
    agree). The files must be readable at the same path from every worker (a shared or a local
    disk on a one-machine cluster). Only the headers are read here.

    Parameters
    ----------
    paths : path or sequence of paths
    block_rows : int, optional
        Rows per block (default: about 64 MiB per block; a file's last block may be smaller).

    Returns
    -------
    dask.array.Array

    Examples
    --------
    >>> X = dt.from_npy(["part-0.npy", "part-1.npy"])          # doctest: +SKIP
    >>> y = dt.from_npy("labels.npy", block_rows=X.chunks[0][0])  # doctest: +SKIP
    """
    names = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else \
        [os.fspath(p) for p in paths]
    if not names:
        raise InvalidInput(["paths=[] is invalid: pass at least one .npy file."])
    problems, headers = [], []
    for name in names:
        try:
            arr = np.load(name, mmap_mode="r")
        except (OSError, ValueError) as exc:
            problems.append(f"paths: {name!r} cannot be read as a .npy file ({exc}); pass "
                            "files written by numpy.save.")
            continue
        headers.append((name, arr.shape, arr.dtype))
    if problems:
        raise InvalidInput(problems)
    _, shape0, dtype0 = headers[0]
    for name, shape, dtype in headers[1:]:
        if shape[1:] != shape0[1:] or dtype != dtype0:
            problems.append(f"paths: {name!r} holds {dtype}{list(shape)} but {headers[0][0]!r} "
                            f"holds {dtype0}{list(shape0)}: files must agree past the first axis.")
    if block_rows is not None and (not isinstance(block_rows, int) or block_rows < 1):
        problems.append(f"block_rows={block_rows!r} is invalid: use an integer >= 1 or None.")
    if problems:
        raise InvalidInput(problems)
    import dask.array as da  # here: a worker reading a block (_read_rows) never needs it

    row_bytes = max(1, int(np.prod(shape0[1:], dtype=np.int64)) * dtype0.itemsize)
    rows_per = block_rows or max(1, DEFAULT_BLOCK_BYTES // row_bytes)
    parts: list[Any] = []
    for name, shape, dtype in headers:
        n = int(shape[0])
        for i in range(max(1, math.ceil(n / rows_per))):
            a, b = i * rows_per, min(n, (i + 1) * rows_per)
            block = dask.delayed(_read_rows, pure=True)(name, a, b, dask_key_name=(
                f"from-npy-{dask.base.tokenize(name, os.path.getmtime(name), a, b)}"))
            parts.append(da.from_delayed(block, shape=(b - a, *shape[1:]), dtype=dtype))
    return parts[0] if len(parts) == 1 else da.concatenate(parts, axis=0)
