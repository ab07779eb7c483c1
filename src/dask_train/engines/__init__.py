"""Engines: the ways a job's gradients become updates, each behind one protocol
(:class:`~dask_train.engines._base.Engine`) that the one controller drives:

* ``async-ps``: trainers push to sharded parameter servers (:mod:`.async_ps`, :mod:`._ps_server`);
* ``sync`` (torch): ranks of a torch process group all-reduce in buckets (:mod:`.sync_torch`);
* ``sync`` (numpy :class:`~dask_train.models.ArrayModel`): per-step tasks where the blocks live,
  summed by a tree reduction (:mod:`.sync_array`).

The torch engines share one scorer (:mod:`._scorer`) and the worker side of stop signals,
pauses and checkpoints (:mod:`._worker`). Modules load when an engine is used.
"""
