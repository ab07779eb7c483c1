"""The public API on top of every layer: :class:`Trainer` and its :class:`FitResult`, and
:func:`run` (the user's own training function) and its :class:`RunResult`."""

from dask_train.api._result import FitResult
from dask_train.api._run import run
from dask_train.api._run_result import RunResult
from dask_train.api._trainer import Trainer

__all__ = ["FitResult", "RunResult", "Trainer", "run"]
