"""Training strategies: asynchronous parameter servers (``async-ps``)."""

from dask_train.strategies.async_ps import ShardServer

__all__ = ["ShardServer"]
