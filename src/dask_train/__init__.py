"""dask-train: train machine-learning models on a Dask cluster.

Public names load lazily (see :mod:`dask_train._lazy`): ``import dask_train`` imports neither torch
nor scikit-learn, SciPy or matplotlib; each loads when a name that needs it is first used.

Examples
--------
>>> import dask_train as dt
>>> client = dt.connect()                                   # doctest: +SKIP
>>> X, y = dt.datasets.digits(n_samples=1_100_000)          # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dask_train._lazy import attach
from dask_train.errors import (
    BlockReadError,
    ClusterMismatch,
    ClusterUnreachable,
    DaskTrainError,
    DataDoesNotFit,
    DataUnreadable,
    InvalidInput,
    NonFiniteLoss,
    ParameterServerLost,
    RoleFailed,
    TrainingTimeout,
    WorkerLost,
)

__version__ = "0.1.0"

_LAZY = {
    # the public API: the Trainer and what it returns
    "Trainer": ".api",
    "FitResult": ".api",
    "run": ".api",
    "RunResult": ".api",
    # a torchrun script, unchanged, on the cluster's workers
    "launch": ".launcher",
    "LaunchResult": ".launcher",
    # pure policies and settings
    "Callback": ".policy",
    "History": ".policy",
    "EarlyStopping": ".policy",
    "StopAfter": ".policy",
    "StopAtScore": ".policy",
    "StopAtStep": ".policy",
    "StopCondition": ".policy",
    "FailureConfig": ".policy",
    "Roles": ".policy",
    "CheckpointConfig": ".checkpoint",
    # the runtime: connecting, roles, torch process groups, tree reduction
    "connect": ".runtime",
    "start_roles": ".runtime",
    "start_torch": ".runtime",
    "TorchGroup": ".runtime",
    # TensorFlow servers inside Dask workers (TensorFlow loads only when used)
    "start_tensorflow": ".tensorflow",
    "TensorFlowCluster": ".tensorflow",
    # models
    "ArrayModel": ".models",
    "softmax_regression": ".models",
    "LinearRegression": ".classical",
    "LogisticRegression": ".classical",
    "PoissonRegression": ".classical",
    "distributed_loss_grad": ".classical",
    "tree_reduce": ".runtime",
    "datasets": ".datasets",
    "from_npy": ".data",
    "patches": ".data",
    "callbacks": ".callbacks",
    # PyTorch Lightning inside dt.run (Lightning loads only when used)
    "lightning": ".lightning",
    # Hugging Face's Trainer and accelerate inside dt.run (transformers loads only when used)
    "huggingface": ".huggingface",
    # prediction and hyper-parameter search
    "predict": ".prediction",
    "search": ".tuning",
    "SearchResult": ".tuning",
    "loguniform": ".tuning",
    "uniform": ".tuning",
    "intuniform": ".tuning",
    # the layers themselves, as modules (``dt.runtime.worker_state``)
    **{layer: f".{layer}" for layer in ("policy", "data", "runtime", "engines", "controller",
                                         "classical", "api", "models", "checkpoint", "report",
                                         "monitor", "prediction", "tuning", "tensorflow")},
}
__getattr__, __dir__, _ = attach(__name__, _LAZY)

__all__ = [
    "ArrayModel",
    "BlockReadError",
    "Callback",
    "CheckpointConfig",
    "ClusterMismatch",
    "ClusterUnreachable",
    "DaskTrainError",
    "DataDoesNotFit",
    "DataUnreadable",
    "EarlyStopping",
    "FailureConfig",
    "FitResult",
    "History",
    "InvalidInput",
    "LaunchResult",
    "LinearRegression",
    "LogisticRegression",
    "NonFiniteLoss",
    "ParameterServerLost",
    "PoissonRegression",
    "RoleFailed",
    "Roles",
    "RunResult",
    "SearchResult",
    "StopAfter",
    "StopAtScore",
    "StopAtStep",
    "StopCondition",
    "TensorFlowCluster",
    "TorchGroup",
    "Trainer",
    "TrainingTimeout",
    "WorkerLost",
    "callbacks",
    "connect",
    "datasets",
    "distributed_loss_grad",
    "from_npy",
    "huggingface",
    "intuniform",
    "launch",
    "lightning",
    "loguniform",
    "patches",
    "predict",
    "run",
    "search",
    "softmax_regression",
    "start_roles",
    "start_tensorflow",
    "start_torch",
    "tree_reduce",
    "uniform",
]

if TYPE_CHECKING:  # static names for type checkers and IDEs; nothing is imported at run time
    from dask_train import callbacks, datasets, huggingface, lightning
    from dask_train.api import FitResult, RunResult, Trainer, run
    from dask_train.checkpoint import CheckpointConfig
    from dask_train.classical import (
        LinearRegression,
        LogisticRegression,
        PoissonRegression,
        distributed_loss_grad,
    )
    from dask_train.data import from_npy
    from dask_train.launcher import LaunchResult, launch
    from dask_train.models import ArrayModel, softmax_regression
    from dask_train.policy import (
        Callback,
        EarlyStopping,
        FailureConfig,
        History,
        Roles,
        StopAfter,
        StopAtScore,
        StopAtStep,
        StopCondition,
    )
    from dask_train.prediction import predict
    from dask_train.runtime import TorchGroup, connect, start_roles, start_torch, tree_reduce
    from dask_train.tensorflow import TensorFlowCluster, start_tensorflow
    from dask_train.tuning import SearchResult, intuniform, loguniform, search, uniform
