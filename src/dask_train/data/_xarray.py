"""xarray inputs: a ``DataArray`` or ``Dataset`` (dask-backed, from ``xr.open_zarr``) as ``X``,
``y`` or a validation pair, turned into the dask arrays of rows every other part reads.

The sample dimension is named by the data: ``y``'s dimension when ``y`` is a 1-D ``DataArray``
(``y.dims == ("time",)``), else ``X``'s first. Every other dimension of ``X`` is flattened into
features, and a ``Dataset``'s data variables are stacked side by side (in their order), so
``ds[["t2m", "u10", "v10"]]`` over ``(time, lat, lon)`` becomes one row per time of
``3 * lat * lon`` features. Nothing is computed: the arrays stay lazy, and a store opened with
``xr.open_zarr`` is read block by block on the workers (streamed, with ``data="stream"``).
xarray itself is never imported here: only objects it made are recognized.
"""

from __future__ import annotations

from typing import Any

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
    if any(hasattr(a, "dask") for a in arrays):
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
