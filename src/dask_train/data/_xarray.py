"""xarray inputs: a ``DataArray`` or ``Dataset`` (dask-backed, from ``xr.open_zarr``) as ``X``,
``y`` or a validation pair, turned into the dask arrays of rows every other part reads.

The sample dimension is named by the data: ``y``'s dimension when ``y`` is a 1-D ``DataArray``
(``y.dims == ("time",)``), else ``X``'s first. Every other dimension of ``X`` is flattened into
features, and a ``Dataset``'s data variables are stacked side by side (in their order), so
``ds[["t2m", "u10", "v10"]]`` over ``(time, lat, lon)`` becomes one row per time of
``3 * lat * lon`` features. Nothing is computed: the arrays stay lazy, and a store opened with
``xr.open_zarr`` is read block by block on the workers (streamed, with ``data="stream"``).
xarray itself is never imported here: only objects it made are recognized.

Patches and windows (:func:`patches`) are cut the way xbatcher's ``BatchGenerator`` cuts them
(``input_dims``, ``input_overlap``), as rows of the same lazy arrays, rather than accepting a
``BatchGenerator`` as it is: a generator yields batches in the process that iterates it, so every
patch would travel through the client, in one fixed order, with no block a trainer could read on
its own worker, shuffle, count in the ledger or take up again after a resume or a lost worker.
Cut as rows, the patches are blocks like any other (streamed or persisted), and xbatcher is not
needed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from dask_train.data._inputs import is_collection
from dask_train.errors import InvalidInput


def is_xarray(obj: Any) -> bool:
    """Whether ``obj`` is an xarray ``DataArray`` or ``Dataset``."""
    return type(obj).__module__.startswith("xarray.") and hasattr(obj, "dims")


def sample_dim(X: Any, y: Any) -> str | None:
    """The sample dimension of ``X`` and ``y`` (None when neither is xarray)."""
    if is_xarray(y) and not hasattr(y, "data_vars") and len(y.dims) == 1:
        return str(y.dims[0])
    if is_xarray(X):
        dims = [d for v in X.data_vars.values() for d in v.dims] if hasattr(X, "data_vars") \
            else list(X.dims)
        return str(dims[0]) if dims else None
    return None


def rows_of(obj: Any, dim: str, *, name: str) -> Any:
    """``obj`` as an array of rows along ``dim``: a 1-D ``DataArray`` as it is, anything else
    with its other dimensions flattened into features (a Dataset's variables side by side)."""
    if not is_xarray(obj):
        return obj
    parts = list(obj.data_vars.items()) if hasattr(obj, "data_vars") else [(obj.name, obj)]
    if not parts:
        raise InvalidInput([f"{name} is an xarray Dataset with no data variables: select the "
                            "variables to train on, e.g. ds[['t2m', 'u10']]."])
    missing = [f"{v!r} {tuple(a.dims)}" for v, a in parts if dim not in a.dims]
    if missing:
        raise InvalidInput([f"{name}: the variables {', '.join(missing)} have no {dim!r} "
                            f"dimension, the sample dimension (y's, or {name}'s first): select "
                            "variables that have it, or transpose so it comes first."])
    arrays = []
    for _, a in parts:
        data = a.transpose(dim, ...).data
        if data.ndim == 1 and len(parts) == 1:
            return data  # a target, or one feature per row: kept 1-D
        arrays.append(data.reshape(data.shape[0], -1))
    if len(arrays) == 1:
        return arrays[0]
    if any(is_collection(a) for a in arrays):
        import dask.array as da

        return da.concatenate([da.asarray(a) for a in arrays], axis=1)
    import numpy as np

    return np.concatenate(arrays, axis=1)


def from_xarray(X: Any, y: Any, *, name: str = "X") -> tuple[Any, Any]:
    """``(X, y)`` with any xarray object among them turned into rows along the sample dimension
    (see the module docstring); other inputs are returned as they are."""
    dim = sample_dim(X, y)
    if dim is None:
        return X, y
    return rows_of(X, dim, name=name), rows_of(y, dim, name="y" if name == "X" else f"{name}'s y")


def patches(obj: Any, input_dims: Mapping[str, int], input_overlap: Mapping[str, int] | None = None,
            *, along: str | None = None, sample_dim: str = "sample") -> Any:
    """Patches (windows) of an xarray object, cut the way xbatcher's ``BatchGenerator`` cuts
    them, as samples of a new dimension ``sample_dim`` that ``Trainer.fit`` takes as rows
    (elsewhere, ``.data.reshape(n_samples, -1)`` is the same rows as a dask array).

    A patch spans ``input_dims[d]`` positions of each dimension ``d``; consecutive patches start
    ``input_dims[d] - input_overlap[d]`` apart, and the ones that would run past the end are
    left out (xbatcher's ``input_dims`` and ``input_overlap``). Every patch at every position of
    ``along`` is a sample: ``sample_dim`` stacks ``along`` and the patch positions, and the patch
    itself is in dimensions named ``<d>_patch``, which ``fit`` flattens into features (with any
    dimension neither patched nor ``along``, and a Dataset's variables side by side). Lazy: the
    patches of a store opened with ``xr.open_zarr`` are cut where its blocks are read, on the
    workers (streamed with ``data="stream"``), and one block of samples holds the patches of one
    chunk of ``along``.

    Parameters
    ----------
    obj : xarray.DataArray or xarray.Dataset
        Backed by dask or numpy; with a Dataset every data variable must have every dimension
        of ``input_dims`` and ``along``.
    input_dims : mapping of str to int
        The patch's size along each dimension cut into patches.
    input_overlap : mapping of str to int, optional
        Positions shared by two neighbouring patches, per dimension (default 0).
    along : str, optional
        The dimension whose every position holds its own patches (time, usually); default the
        first dimension of ``obj`` that is not cut into patches.
    sample_dim : str
        The name of the new dimension of samples.

    Returns
    -------
    xarray.DataArray or xarray.Dataset
        Dimensions ``(sample_dim, <d>_patch..., the others)``.

    Raises
    ------
    InvalidInput
        Every problem with the arguments at once, before anything is read.

    Examples
    --------
    >>> import numpy as np, xarray as xr
    >>> field = xr.DataArray(np.zeros((10, 64, 64)), dims=("time", "lat", "lon"))
    >>> dt.patches(field, {"lat": 32, "lon": 32}, {"lat": 16}).sizes  # doctest: +SKIP
    Frozen({'sample': 60, 'lat_patch': 32, 'lon_patch': 32})
    """
    overlap = dict(input_overlap or {})
    along = along if along is not None else next(
        (str(d) for d in obj.dims if d not in input_dims), None)
    problems = _patch_problems(obj, dict(input_dims), overlap, along=along, sample_dim=sample_dim)
    if problems or along is None:
        raise InvalidInput(problems)
    steps = {d: n - overlap.get(d, 0) for d, n in input_dims.items()}
    if hasattr(obj, "data_vars"):
        return obj.map(_patched, along=along, sizes=dict(input_dims), steps=steps,
                       sample_dim=sample_dim)
    return _patched(obj, along=along, sizes=dict(input_dims), steps=steps, sample_dim=sample_dim)


def _patched(a: Any, *, along: str, sizes: dict[str, int], steps: dict[str, int],
             sample_dim: str) -> Any:
    """One DataArray's patches (see :func:`patches`): cut block by block along ``along``, so a
    block of samples is the patches of one chunk of ``along`` (xarray's ``rolling.construct``
    would split every chunk into single positions)."""
    others = [str(d) for d in a.dims if d != along and d not in sizes]
    a = a.transpose(along, *sizes, *others)
    cut = functools.partial(_cut, sizes=tuple(sizes.values()), steps=tuple(steps.values()))
    per_position = math.prod((a.sizes[d] - n) // steps[d] + 1 for d, n in sizes.items())
    data = a.data
    if is_collection(data):
        # Every block holds whole patches: all of the patched and other dimensions.
        data = data.rechunk({i: -1 for i in range(1, data.ndim)})
        chunks = (tuple(c * per_position for c in data.chunks[0]), *[(n,) for n in sizes.values()],
                  *data.chunks[1 + len(sizes):])
        out = data.map_blocks(cut, chunks=chunks, dtype=data.dtype)
    else:
        out = cut(data)
    dims = (sample_dim, *(f"{d}_patch" for d in sizes), *others)
    return type(a)(out, dims=dims, name=a.name, attrs=a.attrs)


def _cut(block: Any, *, sizes: tuple[int, ...], steps: tuple[int, ...]) -> Any:
    """The patches of a numpy block ``(along, *patched, *others)``: one row a (position of
    along, patch start...), in that order."""
    import numpy as np

    axes = tuple(range(1, 1 + len(sizes)))
    windows = np.lib.stride_tricks.sliding_window_view(block, sizes, axis=axes)
    windows = windows[(slice(None), *(slice(None, None, s) for s in steps))]
    # (along, starts..., others..., window...) -> (along * starts, window..., others...)
    k, n_other = len(sizes), block.ndim - 1 - len(sizes)
    order = (0, *range(1, 1 + k), *range(1 + k + n_other, 1 + 2 * k + n_other),
             *range(1 + k, 1 + k + n_other))
    windows = windows.transpose(order)
    return np.ascontiguousarray(windows.reshape(-1, *windows.shape[1 + k:]))


def _patch_problems(obj: Any, sizes: dict[str, int], overlap: dict[str, int], *,
                    along: str | None, sample_dim: str) -> list[str]:
    """Every problem with :func:`patches`' arguments."""
    if not is_xarray(obj):
        return [f"patches() takes an xarray DataArray or Dataset, not {type(obj).__name__}: "
                "open the store with xr.open_zarr, or cut rows of a dask array yourself."]
    dims = dict(obj.sizes)
    shown = ", ".join(f"{d}={n}" for d, n in dims.items())
    problems = [f"input_dims: {d!r} is not a dimension of the data (its dimensions: {shown})."
                for d in sizes if d not in dims]
    problems += [f"input_dims[{d!r}]={n!r} is invalid: use an integer from 1 to the dimension's "
                 f"size, {dims[d]}." for d, n in sizes.items() if d in dims and
                 (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= dims[d])]
    for d, v in overlap.items():
        if d not in sizes:
            problems.append(f"input_overlap: {d!r} is not in input_dims {sorted(sizes)}: overlap "
                            "only the dimensions cut into patches.")
        elif isinstance(v, bool) or not isinstance(v, int) or \
                isinstance(sizes[d], int) and not 0 <= v < sizes[d]:
            problems.append(f"input_overlap[{d!r}]={v!r} is invalid: use an integer from 0 to "
                            f"input_dims[{d!r}] - 1.")
    if not sizes:
        problems.append("input_dims={} is empty: name the dimensions to cut into patches and "
                        "their sizes, e.g. {'lat': 32, 'lon': 32}.")
    if along is None or along not in dims or along in sizes:
        problems.append(f"along={along!r} is invalid: name a dimension of the data that is not "
                        f"cut into patches (its dimensions: {shown}).")
    taken = [n for n in (sample_dim, *(f"{d}_patch" for d in sizes)) if n in dims]
    problems += [f"the data already has a dimension {n!r}: "
                 + ("pass another sample_dim=." if n == sample_dim else "rename it.") for n in taken]
    if hasattr(obj, "data_vars"):
        needed = {str(d) for d in (*sizes, along) if d in dims}
        problems += [f"the variable {v!r} {tuple(a.dims)} lacks {sorted(needed - set(a.dims))}: "
                     "select variables that have every patched dimension and along."
                     for v, a in obj.data_vars.items() if needed - set(a.dims)]
    return problems
