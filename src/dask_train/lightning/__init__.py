"""PyTorch Lightning inside ``dt.run``: a ``lightning.pytorch.Trainer`` on every rank of the job.

``dt.run`` starts the ranks' process group and sets each rank's environment as ``torchrun`` does;
Lightning's DDP strategy takes the group as it finds it. Small parts connect the rest:

* :class:`DaskEnvironment`, a Lightning ``ClusterEnvironment``: every rank is its own node of one
  device (``Trainer(devices=1, num_nodes=ctx.world_size)``), whatever the number of Dask workers
  on each host; Lightning starts no process of its own.
* :class:`Report`, a Lightning callback: at the end of every training epoch it sends
  ``trainer.callback_metrics`` (what ``self.log`` logged) to ``ctx.report`` on every rank, so
  they reach the job's history, callbacks and stop conditions, and a stop of the job sets
  ``trainer.should_stop``.
* :func:`batches`: a ``DataLoader`` over this rank's share of the streamed data set
  (``ctx.batches``), for ``train_dataloader``.
* :func:`checkpoint_path`: after a lost worker, ``dt.run`` starts every rank again (a new
  process group, the function called anew in the surviving processes); with
  ``Report(ctx, checkpoint=True)`` each epoch's Lightning checkpoint is the job's, and
  ``trainer.fit(..., ckpt_path=checkpoint_path(ctx))`` goes on from the newest.

Importing this module imports Lightning (``pip install lightning``); ``import dask_train`` does not.

Examples
--------
>>> import lightning.pytorch as pl                                           # doctest: +SKIP
>>> def train(ctx, epochs=10):                                               # doctest: +SKIP
...     trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=1,
...                          num_nodes=ctx.world_size, max_epochs=epochs,
...                          plugins=[dt.lightning.DaskEnvironment()],
...                          callbacks=[dt.lightning.Report(ctx)])
...     trainer.fit(MyModule(), train_dataloaders=dt.lightning.batches(ctx, batch_size=64))
"""

from __future__ import annotations

from dask_train.lightning._parts import DaskEnvironment, Report, batches, checkpoint_path

__all__ = ["DaskEnvironment", "Report", "batches", "checkpoint_path"]
