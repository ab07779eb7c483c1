"""Control layer: the Trainer, its job controller, stop conditions and callbacks."""

from dask_train.control._result import FitResult
from dask_train.control._trainer import Trainer
from dask_train.control.callbacks import Callback, History
from dask_train.control.stop import (
    EarlyStopping,
    StopAfter,
    StopAtScore,
    StopAtStep,
    StopCondition,
)

__all__ = [
    "Callback",
    "EarlyStopping",
    "FitResult",
    "History",
    "StopAfter",
    "StopAtScore",
    "StopAtStep",
    "StopCondition",
    "Trainer",
]
