"""Adapters between an ML framework and the dask-train core (torch first)."""

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
    "CLASSIFICATION_LOSSES",
    "LOSSES",
    "OPTIMIZERS",
    "FlatModel",
    "Shard",
    "build_optimizer",
    "evaluate",
    "flatten_parameters",
    "split_shards",
]
