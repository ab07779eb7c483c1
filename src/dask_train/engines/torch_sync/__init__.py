"""The synchronous torch engine: one rank per worker in a torch process group, gradients
all-reduced every step (:class:`~dask_train.engines.torch_sync.engine.TorchSyncEngine`)."""
