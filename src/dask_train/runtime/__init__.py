"""Runtime on the Dask workers: connecting, the worker plugin and its RPC handler registry,
placing roles, torch process groups inside worker processes."""

from dask_train.runtime._connect import connect
from dask_train.runtime._plugin import DaskTrainPlugin, register_handler, worker_state
from dask_train.runtime._roles import ensure_plugin, start_roles, worker_threads
from dask_train.runtime._torch_group import TorchGroup, start_torch

__all__ = [
    "DaskTrainPlugin",
    "TorchGroup",
    "connect",
    "ensure_plugin",
    "register_handler",
    "start_roles",
    "start_torch",
    "worker_state",
    "worker_threads",
]
