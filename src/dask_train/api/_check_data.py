"""Where the data checks were: they live in :mod:`dask_train.data._checks` now; kept for the
modules that still import them from here (``api._validate``, ``api._run``)."""

from __future__ import annotations

from dask_train.data._checks import check_data, check_validation

__all__ = ["check_data", "check_validation"]
