"""The numpy sync engine: an ArrayModel trained by per-step tasks where its blocks live
(:class:`~dask_train.engines.array.engine.ArrayEngine`)."""
