"""Engines: the ways a job's gradients become updates, each behind one protocol
(:class:`~dask_train.engines._protocol.Engine`, typed events in :mod:`._events`) that the one
controller drives. One subpackage per engine, each holding its engine class (``engine.py``, client
side) and its worker-side code:

* :mod:`.ps`: async parameter servers. ``engine.py``; ``trainer.py`` (a trainer's loop);
  ``server.py`` (a shard).
* :mod:`.torch_sync`: ranks of a torch process group all-reduce every step. ``engine.py``;
  ``rank.py`` (a rank's loop).
* :mod:`.run`: ``dt.run``, the user's own function on every rank. ``engine.py``; ``rank.py``;
  ``context.py`` (the ``ctx`` it gets); ``host_parallel.py`` (``ctx.prepare`` on one host);
  ``metrics.py`` (what ``ctx.report`` accepts).
* :mod:`.array`: numpy :class:`~dask_train.models.ArrayModel` s trained by per-step tasks where the
  blocks live, summed by a tree reduction. ``engine.py``; ``worker.py``.

What the engines share, by concern:

* :mod:`.roles`: the client-side base of the engines whose trainers are pinned tasks.
* :mod:`.harness`: the worker-side role harness, stats and control signals.
* :mod:`.holders`: parameter holders (shards, host memory, the flat optimizer) and how roles
  reach them.
* :mod:`.scoring`: the scorer role and the score keeper.
* :mod:`.collectives`: the sync gradient reducers.
* :mod:`.measure`: what ``strategy="auto"`` and ``ps="auto"`` measure on the cluster.

The job's settings are :mod:`._spec` (``JobSpec``, and the ``RoleConfig`` the roles receive).
Modules load when an engine is used.
"""

from dask_train.engines import _handlers  # noqa: F401  (the workers' RPC handlers, by name)
