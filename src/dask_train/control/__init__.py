"""Control layer: the Trainer, its job controller, stop conditions and callbacks."""

from dask_train.control._failure import Action, Decision, FailureConfig, JobStatus, decide
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
    "Action",
    "Callback",
    "Decision",
    "EarlyStopping",
    "FailureConfig",
    "FitResult",
    "History",
    "JobStatus",
    "StopAfter",
    "StopAtScore",
    "StopAtStep",
    "StopCondition",
    "Trainer",
    "decide",
]
