"""Runtime on the Dask workers: connecting, the worker plugin and its RPC handler registry,
placing roles, torch process groups inside worker processes, tree reduction on the workers."""

from dask_train.runtime._connect import connect, default_client
from dask_train.runtime._plugin import DaskTrainPlugin, register_handler, worker_state
from dask_train.runtime._reduce import add_terms, send_params, tree_reduce
from dask_train.runtime._roles import ensure_plugin, start_roles, worker_threads
from dask_train.runtime._torch_group import TorchGroup, start_torch

__all__ = [
    "DaskTrainPlugin",
    "TorchGroup",
    "add_terms",
    "connect",
    "default_client",
    "ensure_plugin",
    "register_handler",
    "send_params",
    "start_roles",
    "start_torch",
    "tree_reduce",
    "worker_state",
    "worker_threads",
]
