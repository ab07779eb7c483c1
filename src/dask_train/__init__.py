"""dask-train: train machine-learning models on a Dask cluster.

Examples
--------
>>> import dask_train as dt
>>> client = dt.connect()                                   # doctest: +SKIP
>>> X, y = dt.datasets.digits(n_samples=1_100_000)          # doctest: +SKIP
"""

from dask_train import datasets
from dask_train.checkpoint import CheckpointConfig
from dask_train.cluster import Roles, TorchGroup, connect, start_roles, start_torch
from dask_train.control import (
    Callback,
    EarlyStopping,
    FailureConfig,
    FitResult,
    History,
    StopAfter,
    StopAtScore,
    StopAtStep,
    StopCondition,
    Trainer,
)
from dask_train.errors import (
    ClusterUnreachable,
    DaskTrainError,
    InvalidInput,
    ParameterServerLost,
    RoleFailed,
    TrainingTimeout,
    WorkerLost,
)
from dask_train.models import (
    ArrayModel,
    LinearRegression,
    LogisticRegression,
    PoissonRegression,
    softmax_regression,
)
from dask_train.strategies import distributed_loss_grad, tree_reduce

__version__ = "0.1.0"

__all__ = [
    "ArrayModel",
    "Callback",
    "CheckpointConfig",
    "ClusterUnreachable",
    "DaskTrainError",
    "EarlyStopping",
    "FailureConfig",
    "FitResult",
    "History",
    "InvalidInput",
    "LinearRegression",
    "LogisticRegression",
    "ParameterServerLost",
    "PoissonRegression",
    "RoleFailed",
    "Roles",
    "StopAfter",
    "StopAtScore",
    "StopAtStep",
    "StopCondition",
    "TorchGroup",
    "Trainer",
    "TrainingTimeout",
    "WorkerLost",
    "connect",
    "datasets",
    "distributed_loss_grad",
    "start_roles",
    "softmax_regression",
    "start_torch",
    "tree_reduce",
]
