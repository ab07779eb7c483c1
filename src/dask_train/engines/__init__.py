"""Engines: the ways a job's gradients become updates, each behind one protocol
(:class:`~dask_train.engines._protocol.Engine`, typed events in :mod:`._events`) that the one
controller drives. One subpackage per engine, each holding its engine class (``engine.py``, client
side) and its worker-side code:

* :mod:`.ps`: async parameter servers. ``engine.py``; ``trainer.py`` (a trainer's loop);
  ``server.py`` (a shard); ``probe.py`` (the per-step costs ``ps="auto"`` measures).
* :mod:`.torch_sync`: ranks of a torch process group all-reduce in buckets. ``engine.py``;
  ``rank.py`` (a rank's loop); ``reducer.py`` (the bucketed all-reduce).
* :mod:`.array`: numpy :class:`~dask_train.models.ArrayModel` s trained by per-step tasks where the
  blocks live, summed by a tree reduction. ``engine.py``; ``worker.py``.
* :mod:`.shared`: what the engines share: the base of the engines whose trainers are pinned tasks
  (``role_engine.py``, ``granting.py``), the worker-side role harness (``harness.py``), the scorer
  and the score keeper (``scorer.py``, ``scoring.py``), parameter holders and how roles reach them
  (``holders.py``, ``params.py``, ``push_socket.py``), the flat optimizer (``optim.py``), control
  signals (``control.py``) and stats (``stats.py``).

The job's settings are :mod:`._spec` (``JobSpec``, and the ``WorkerConfig`` the roles receive).
Modules load when an engine is used.
"""
