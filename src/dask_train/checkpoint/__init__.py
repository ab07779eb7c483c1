"""Checkpoints: safetensors files written atomically to a local path or any fsspec URL.

Examples
--------
>>> import tempfile, torch
>>> from dask_train.checkpoint import load_module, save_module
>>> path = save_module(torch.nn.Linear(4, 2), tempfile.mkdtemp() + "/model.safetensors")
>>> net = load_module(torch.nn.Linear(4, 2), path)
"""

from dask_train.checkpoint._io import load_metadata, load_shapes, load_tensors, save_tensors
from dask_train.checkpoint._module import load_module, save_module
from dask_train.checkpoint._shard import (
    ShardState,
    load_shard,
    read_slice,
    restore_optimizer,
    save_shard,
)
from dask_train.checkpoint._state import load_state, save_state
from dask_train.checkpoint._store import CheckpointConfig, CheckpointStore

__all__ = [
    "CheckpointConfig",
    "CheckpointStore",
    "ShardState",
    "load_metadata",
    "load_module",
    "load_shapes",
    "load_shard",
    "load_state",
    "load_tensors",
    "read_slice",
    "restore_optimizer",
    "save_module",
    "save_shard",
    "save_state",
    "save_tensors",
]
