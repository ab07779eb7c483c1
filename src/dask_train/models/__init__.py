"""Adapters between an ML framework and the dask-train core (torch first); classical GLM estimators."""

from dask_train.models._array import ArrayModel, softmax_regression
from dask_train.models._glm import LinearRegression, LogisticRegression, PoissonRegression
from dask_train.models._glm_losses import GLMBlockLoss
from dask_train.models._torch import (
    CLASSIFICATION_LOSSES,
    LOSSES,
    OPTIMIZERS,
    FlatModel,
    Shard,
    build_optimizer,
    evaluate,
    flatten_parameters,
    split_shards,
)

__all__ = [
    "ArrayModel",
    "CLASSIFICATION_LOSSES",
    "LOSSES",
    "OPTIMIZERS",
    "FlatModel",
    "GLMBlockLoss",
    "LinearRegression",
    "LogisticRegression",
    "PoissonRegression",
    "Shard",
    "build_optimizer",
    "evaluate",
    "flatten_parameters",
    "softmax_regression",
    "split_shards",
]
