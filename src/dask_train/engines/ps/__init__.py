"""The async parameter-server engine: trainers push gradients to sharded servers and pull back the
parameters (:class:`~dask_train.engines.ps.engine.AsyncPSEngine`)."""
