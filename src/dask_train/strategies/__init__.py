"""Training strategies: asynchronous parameter servers (``async-ps``); full-batch sums (``full_batch``)."""

from dask_train.strategies.async_ps import ShardServer
from dask_train.strategies.full_batch import (
    BlockData,
    distributed_loss_grad,
    persist_data,
    tree_reduce,
)

__all__ = ["BlockData", "ShardServer", "distributed_loss_grad", "persist_data", "tree_reduce"]
