"""The public API on top of every layer: :class:`Trainer` and its :class:`FitResult`."""

from dask_train.api._result import FitResult
from dask_train.api._trainer import Trainer

__all__ = ["FitResult", "Trainer"]
