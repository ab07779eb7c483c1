"""Cluster layer: connecting, placing roles on Dask workers, per-worker state."""

from dask_train.cluster._connect import connect
from dask_train.cluster._plugin import DaskTrainPlugin, worker_state
from dask_train.cluster._roles import Roles, plan_roles, start_roles
from dask_train.cluster._torch_group import TorchGroup, start_torch

__all__ = [
    "DaskTrainPlugin",
    "Roles",
    "TorchGroup",
    "connect",
    "plan_roles",
    "start_roles",
    "start_torch",
    "worker_state",
]
