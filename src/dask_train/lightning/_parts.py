"""The Lightning parts of :mod:`dask_train.lightning`: the cluster environment, the report
callback and the data loader (see the package docstring)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, IterableDataset

from dask_train.engines.run.metrics import check_report_options, logged_numbers
from dask_train.errors import InvalidInput


class DaskEnvironment(ClusterEnvironment):
    """Lightning's view of a ``dt.run`` job: one node of one device per rank.

    A Dask worker is one process, and a host may run any number of them, so the job's ranks are
    not Lightning's "nodes of equal size"; each rank is its own node instead (``node_rank`` is
    the rank, ``local_rank`` 0). Pass ``Trainer(devices=1, num_nodes=ctx.world_size,
    plugins=[DaskEnvironment()])``; on a GPU job ``devices=[ctx.device.index]`` and
    ``accelerator="gpu"``. The ranks and the process group come from ``dt.run`` (the group is
    already initialised, so Lightning starts none and launches no process).

    Examples
    --------
    >>> env = DaskEnvironment()                                              # doctest: +SKIP
    >>> env.global_rank(), env.world_size()                                  # doctest: +SKIP
    (1, 2)
    """

    @property
    def creates_processes_externally(self) -> bool:
        """True: Dask started every rank's process."""
        return True

    @property
    def main_address(self) -> str:
        """The host of the job's process group store (``MASTER_ADDR``)."""
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        """The port of the job's process group store (``MASTER_PORT``)."""
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        """True inside a ``dt.run`` rank (its process group is up and ``RANK`` set)."""
        return torch.distributed.is_available() and torch.distributed.is_initialized() and \
            "RANK" in os.environ

    def world_size(self) -> int:
        """The job's ranks."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return int(torch.distributed.get_world_size())
        return int(os.environ.get("WORLD_SIZE", "1"))

    def set_world_size(self, size: int) -> None:
        """Ignored: ``dt.run`` decides the ranks."""

    def global_rank(self) -> int:
        """This rank."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return int(torch.distributed.get_rank())
        return int(os.environ.get("RANK", "0"))

    def set_global_rank(self, rank: int) -> None:
        """Ignored: ``dt.run`` decides the ranks."""

    def local_rank(self) -> int:
        """0: each rank is a node of one device."""
        return 0

    def node_rank(self) -> int:
        """The rank: each rank is its own node."""
        return self.global_rank()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Lightning's devices and nodes must be one device per rank."""
        world = self.world_size()
        if num_devices != 1 or num_nodes != world:
            raise InvalidInput([f"Trainer(devices={num_devices}, num_nodes={num_nodes}) does not "
                                f"fit a dt.run job of {world} ranks: pass devices=1 (or "
                                f"devices=[ctx.device.index] on GPUs) and num_nodes="
                                "ctx.world_size."])


class Report(Callback):
    """Send Lightning's logged metrics to the ``dt.run`` job, and stop when the job stops.

    At the end of every training epoch (after its validation), on every rank: the numbers in
    ``trainer.callback_metrics`` (what ``self.log`` logged, the epoch's validation included) go to
    ``ctx.report``, so every rank reports the same number of times; they reach the job's history,
    callbacks and stop conditions. When the job stops (a stop condition, a callback),
    ``trainer.should_stop`` is set on every rank after the same epoch.

    With ``checkpoint=True`` each report also carries Lightning's own checkpoint of the epoch
    (what ``trainer.save_checkpoint`` writes: the module's and the optimizers' states, the loops'
    counters, the callbacks' states), written by the job as a ``dt.run`` checkpoint (safetensors
    and JSON, no pickle) with every rank's place in the data. After a lost worker the job starts
    every rank again from the newest one: pass :func:`checkpoint_path` as ``ckpt_path`` to
    ``trainer.fit`` and Lightning goes on from the epoch after it, on the data the ledger has not
    given out since.

    Parameters
    ----------
    ctx : RunContext
        The rank's context (``dt.run``'s first argument to your function).
    metrics : sequence of str, optional
        Only these logged names; all of them by default.
    reduce : {None, "mean", "sum", "min", "max"}
        As ``ctx.report``: rank 0's metrics, or the ranks' combined. Metrics logged with
        ``sync_dist=True`` are the same on every rank already.
    checkpoint : bool
        Report Lightning's checkpoint each epoch (the job needs ``checkpoint=dt.CheckpointConfig``).

    Examples
    --------
    >>> trainer = pl.Trainer(..., callbacks=[dt.lightning.Report(ctx, checkpoint=True)])  # doctest: +SKIP
    >>> trainer.fit(module, train_dataloaders=dt.lightning.batches(ctx),
    ...             ckpt_path=dt.lightning.checkpoint_path(ctx))                           # doctest: +SKIP
    """

    def __init__(self, ctx: Any, *, metrics: Sequence[str] | None = None,
                 reduce: str | None = None, checkpoint: bool = False) -> None:
        check_report_options(ctx, metrics, reduce, checkpoint)
        self.ctx, self.reduce, self.checkpoint = ctx, reduce, checkpoint
        self.metrics = None if metrics is None else list(metrics)
        self.reports = 0

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Report the epoch's metrics; stop the trainer when the job stops."""
        if trainer.sanity_checking:
            return
        values = logged_numbers(trainer.callback_metrics, self.metrics)
        state = None
        if self.checkpoint:
            # Every rank builds it, as Lightning's ModelCheckpoint does (a strategy may gather
            # its state collectively); rank 0's is written (DDP's ranks hold the same).
            state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        self.ctx.report(values, reduce=self.reduce,
                        checkpoint=state if self.ctx.rank == 0 else None)
        self.reports += 1
        if self.ctx.should_stop():
            trainer.should_stop = True


def checkpoint_path(ctx: Any) -> str | None:
    """The job's newest checkpoint as a Lightning checkpoint file for ``trainer.fit(...,
    ckpt_path=...)``, or None on a fresh start (Lightning then starts from scratch).

    The state :class:`Report` reported (``checkpoint=True``), read back from the job's
    checkpoint (safetensors and JSON) and saved with ``torch.save`` in ``ctx.scratch_dir`` (on
    this rank's worker, removed when the function returns): tensors, numbers, strings and
    containers only, which Lightning loads
    with ``torch.load(weights_only=True)``.
    """
    state = ctx.restore()
    if state is None:
        return None
    import tempfile

    if not isinstance(state, dict) or "state_dict" not in state:
        raise InvalidInput(["checkpoint_path(ctx): the job's checkpoint is not Lightning's (it "
                            "was not reported by dt.lightning.Report(ctx, checkpoint=True)); "
                            "read it with ctx.restore()."])
    path = os.path.join(tempfile.mkdtemp(prefix="resume-", dir=ctx.scratch_dir), "resume.ckpt")
    torch.save(state, path)
    return path


class _Share(IterableDataset):  # type: ignore[type-arg]
    """This rank's share of one epoch of the streamed data set, a batch at a time."""

    def __init__(self, ctx: Any, name: str | None, batch_size: int | None) -> None:
        self.ctx, self.name, self.batch_size = ctx, name, batch_size

    def __iter__(self) -> Iterator[Any]:
        return iter(self.ctx.batches(self.name, batch_size=self.batch_size, even=True))


def batches(ctx: Any, name: str | None = None, batch_size: int | None = None) -> DataLoader:
    """A ``DataLoader`` over this rank's batches of the streamed data set, one epoch per pass.

    Each pass is one ``ctx.batches(name, batch_size, even=True)``: tensors already batched (the
    loader adds no batching, sampler or worker processes: Dask workers cannot start any), each
    row once per epoch over all ranks, and the same number of batches on every rank (a rank
    whose share ran out repeats its last batch): Lightning's DDP steps hold collectives of their
    own (a broadcast every step), so every rank must take as many as the others. Return it from
    ``train_dataloader`` or pass it to ``Trainer.fit``.

    Parameters
    ----------
    ctx : RunContext
    name : str, optional
        The streamed data set (the first of ``dt.run(data=)``).
    batch_size : int, optional
        Rows a batch; ``dt.run(batch_size=)`` by default.

    Examples
    --------
    >>> trainer.fit(module, train_dataloaders=dt.lightning.batches(ctx, batch_size=64))  # doctest: +SKIP
    """
    if batch_size is not None and (isinstance(batch_size, bool) or
                                   not isinstance(batch_size, int) or batch_size < 1):
        raise InvalidInput([f"batches(batch_size={batch_size!r}): use an integer >= 1."])
    return DataLoader(_Share(ctx, name, batch_size), batch_size=None)


__all__ = ["DaskEnvironment", "Report", "batches", "checkpoint_path"]
