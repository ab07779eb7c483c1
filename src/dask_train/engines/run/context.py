"""``ctx``: what a user's training function gets on each rank of a ``dt.run`` job.

The function owns the loop; the context gives it the job's parts that are not the loop: the
rank's device and process group (:meth:`RunContext.prepare`), this rank's share of the data, block
by block from the same ledger the Trainer reads (:meth:`RunContext.batches`), the epochs left
(:meth:`RunContext.epochs`), scores and checkpoints (:meth:`RunContext.report`), the state to
start from after a restart (:meth:`RunContext.restore`) and the job's stop decision
(:meth:`RunContext.should_stop`).

Every rank must call :meth:`~RunContext.report` the same number of times, as with Ray Train's
``train.report``: each call is a point where the ranks and the controller meet (the scores are
recorded and the stop conditions looked at, the checkpoint written with every rank's data position),
which is what lets every rank see the same :meth:`~RunContext.should_stop`.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dask_train.checkpoint._io import options_of
from dask_train.checkpoint._sharded import load_sharded, save_sharded
from dask_train.data._feed import FeedItem, block_order
from dask_train.engines._events import Reported, ShareDone
from dask_train.engines.harness.role import BlockCursor, TrainerRole, rng_state
from dask_train.engines.run.metrics import REDUCTIONS, numbers
from dask_train.errors import InvalidInput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSettings:
    """What every rank of a ``dt.run`` generation receives besides the function.

    ``train`` names the streamed data set (None without one); ``labels`` is False when it has no
    targets (``data={"train": X}``); ``small`` holds the other named sets, whole, as numpy;
    ``checkpointing`` is False without a ``CheckpointConfig`` (a checkpoint given to ``report``
    is then not stored, said once in the log: it is kept until the next report, for a hand-over,
    unless sharded); ``local_ranks`` (each rank's index among the ranks on
    its host) and ``master`` (the group's store, ``host:port``) are what torchrun would tell it.
    ``sharded_root``: where the ranks write a sharded state (``report(sharded=True)``) before
    the controller adopts it into its checkpoint (a ``StoragePath`` with the checkpoint's
    ``storage_options``, if it has any). ``block_rows``: the rows of each block of the streamed
    set (filled in by the engine), for :meth:`RunContext.steps_per_epoch`.
    """

    train: str | None
    labels: bool = True
    small: dict[str, Any] = field(default_factory=dict)
    checkpointing: bool = False
    epochs: int | None = None
    batch_size: int = 64
    local_ranks: tuple[int, ...] = ()
    master: str = ""
    sharded_root: str = ""
    block_rows: tuple[int, ...] = ()
    #: The job may run on more than one rank (``workers=(least, most)`` with ``most`` above 1,
    #: or ``workers=None``): :meth:`RunContext.prepare` wraps the model on one rank too.
    may_grow: bool = False


class RunContext:
    """A rank's view of its ``dt.run`` job (see the module docstring).

    Attributes
    ----------
    rank, world_size, local_rank : int
        This rank, the number of ranks, and its index among the ranks on its host.
    device : torch.device
        Where this rank computes: its GPU when every worker of the job has one, else the CPU.
    config : dict
        The ``config=`` the job was started with.
    epoch : int
        The epoch :meth:`epochs` is in (-1 before it starts).
    step : int
        Batches this rank has taken (counted on from the checkpoint after a restart).
    scratch_dir : str
        A directory of this rank's own in its Dask worker's local directory, removed when the
        function returns or raises (a framework's ``output_dir``, a resume checkpoint).
    """

    def __init__(self, role: TrainerRole, *, run: RunSettings, config: Mapping[str, Any],
                 world_size: int, local_rank: int, device: Any, restore: Mapping[str, Any] | None):
        self._role, self._run, self.config = role, run, dict(config)
        self.rank, self.world_size, self.local_rank = role.index, world_size, local_rank
        self.device = device
        self._restore_info = restore
        self._restored: Any = None
        self._cursor = BlockCursor(role) if run.train is not None else None
        # A rank's last second, as every trainer's: the Training page, Prometheus, on_stats.
        restored_steps = int(restore["step"]) if restore else 0
        self._stats = role.stats(start={"steps": restored_steps}) if run.train is not None \
            else None
        self._joinables: list[Any] = []
        self._host: Any = None  # the models averaged through host memory (host_parallel.HostGroup)
        self._last_batch: Any = None  # what ctx.batches(even=True) repeats once a share ran out
        self._reports = 0
        self._stop = False
        self._said_no_store = False
        self.epoch = -1
        self.step = int(restore["step"]) if restore else 0
        # The ledger epoch the next ctx.batches() reads: every rank's k-th call reads the same
        # epoch, whatever share of it the rank got (none, with fewer blocks than ranks).
        self._data_epoch = int(restore.get("next_epoch", 0)) if restore else 0
        self._first_epoch = self._data_epoch
        self._scratch: str | None = None

    @property
    def scratch_dir(self) -> str:
        """A directory of this rank's own in its Dask worker's local directory, made at the first
        read and removed with what is in it when the function returns or raises: for what a
        framework writes only to read back in the same run (Hugging Face's ``output_dir``, the
        checkpoint ``dt.huggingface.checkpoint_path`` rebuilds). The job's checkpoints are kept
        elsewhere (:meth:`report`)."""
        if self._scratch is None:
            # In the worker's own directory: Dask removes what a killed worker left there when
            # the next worker starts on that machine.
            self._scratch = tempfile.mkdtemp(prefix=f"dask-train-rank{self.rank}-",
                                             dir=getattr(self._role.worker, "local_directory",
                                                         None))
        return self._scratch

    # -- the model ---------------------------------------------------------------------------------
    def prepare(self, model: Any, **ddp_options: Any) -> Any:
        """``model`` on this rank's device, wrapped for data-parallel training over the ranks.

        With one rank the model comes back unwrapped (as Ray Train's ``prepare_model`` does),
        unless the job may run on more ranks (``workers=(1, n)``, ``workers=None``): then in a
        wrapper with DDP's ``.module`` and ``no_sync()``, so that the same code runs at every
        size the job takes as workers leave and join.
        With more than one rank every rank starts from rank 0's parameters and ``backward``
        averages the gradients over the ranks. When the ranks share one host and compute on its
        CPU, the model is wrapped in a ``HostDataParallel`` that sums through the host's memory
        (``.module`` and ``no_sync()`` as with DDP, see ``engines/run/host_parallel.py``);
        otherwise, or with ``ddp_options``, in ``torch.nn.parallel.DistributedDataParallel``
        (``ddp_options`` go to it). Either way :meth:`batches` lets a rank whose share of an
        epoch ran out early take part in the others' sums with zeros, so uneven shares never
        hang (DDP under ``torch.distributed.algorithms.Join``).
        """
        import torch

        if not isinstance(model, torch.nn.Module):
            raise InvalidInput([f"ctx.prepare(model={type(model).__name__}): pass a "
                                "torch.nn.Module."])
        model = model.to(self.device)
        from dask_train.engines.run import host_parallel

        if self.world_size == 1:
            return host_parallel.OneRank(model) if self._run.may_grow else model
        from torch.nn.parallel import DistributedDataParallel

        if host_parallel.eligible(model, self.device, ddp_options):
            if self._host is None:
                self._host = host_parallel.HostGroup(
                    rank=self.rank, world=self.world_size, address=self._role.address,
                    timeout=self._role.config.timeout)
            if self._host.join(model):
                return host_parallel.HostDataParallel(model, self._host)
        ids = [self.device] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=ids, **ddp_options)
        self._joinables.append(wrapped)
        return wrapped

    # -- data --------------------------------------------------------------------------------------
    def epochs(self, n: int | None = None) -> Iterator[int]:
        """The epochs left: from 0, or after a restart from the checkpoint's, up to ``n``
        (``dt.run(epochs=)`` when None); ends early once the job is stopping."""
        n = self._run.epochs if n is None else n
        if n is None or not isinstance(n, int) or n < 0:
            raise InvalidInput([f"ctx.epochs(n={n!r}): pass the number of epochs, or give "
                                "dt.run(epochs=)."])
        for epoch in range(self._first_epoch, n):
            if self.should_stop():
                return
            self.epoch = self._data_epoch = epoch
            yield epoch

    def batches(self, name: str | None = None, batch_size: int | None = None, *,
                even: bool = False) -> Iterator[Any]:
        """This rank's batches of one epoch of the streamed data set: ``(x, y)`` tensors on
        :attr:`device` (``x`` a dict for a dict of inputs; ``x`` alone without targets).

        Blocks come from the job's ledger (the ones this worker holds first), each row once per
        epoch over all ranks, shuffled per epoch from ``dt.run(seed=)``. Leaving the loop early
        and calling again goes on where it left.

        ``even=True`` gives every rank the same number of batches: a rank whose share ran out
        repeats its last batch until every share is read (as ``DistributedSampler`` pads its
        shards), one small all-reduce a batch deciding it. Use it when every step holds
        collectives that ``Join`` cannot shadow: PyTorch Lightning (it broadcasts every step),
        FSDP, all-reduces of your own.
        """
        cursor = self._cursor
        if cursor is None or name not in (None, self._run.train):
            raise InvalidInput([f"ctx.batches({name!r}): this job streams "
                                f"{self._run.train!r}; pass dt.run(data={{{name!r}: (X, y)}})"
                                if cursor is not None else
                                f"ctx.batches({name!r}): the job was given no data=; pass "
                                "dt.run(data={'train': (X, y)})."])
        size = self._run.batch_size if batch_size is None else int(batch_size)
        if size < 1:
            raise InvalidInput([f"ctx.batches(batch_size={batch_size!r}): use an integer >= 1."])
        join: Any = contextlib.nullcontext()
        if self._joinables and not even:
            from torch.distributed.algorithms import Join

            join = Join(self._joinables)
        with join:
            epoch = self._epoch_batches(cursor, size, self._data_epoch)
            yield from self._even(epoch) if even and self.world_size > 1 else epoch
            # Reports the others make inside their batch loops stop waiting for this rank.
            self._role.worker.log_event(self._role.config.topic, ShareDone(
                trainer=self.rank, epoch=self._data_epoch, reports=self._reports).message())
            if self._host is not None and self._host.host is not None and not even:
                self._host.shadow()
        self._data_epoch += 1
        self._epoch_end()

    def _epoch_end(self) -> None:
        """Every rank at the end of the same epoch: take the most reports any rank made inside
        its loop (a rank whose share ran out early made fewer) and any stop decided there, so the
        ranks go on counting and stopping together."""
        if self.world_size == 1:
            return
        import torch
        import torch.distributed as dist

        both = torch.tensor([float(self._reports), float(self._stop)], dtype=torch.float64)
        if self.device.type == "cuda":
            both = both.to(self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        self._reports, self._stop = int(both[0].item()), bool(both[1].item())

    def _even(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, then this rank's last batch again until every rank's share is read."""
        import torch
        import torch.distributed as dist

        while True:
            batch = next(batches, None)
            more = torch.tensor([0.0 if batch is None else 1.0], device=self.device)
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if not more.item():
                return
            if batch is None:
                if self._last_batch is None:
                    raise RuntimeError(f"rank {self.rank} got no rows of the streamed data yet, "
                                       "so ctx.batches(even=True) has no batch to repeat: give "
                                       "dt.run more row blocks than ranks")
                batch = self._last_batch
                self.step += 1
            self._last_batch = batch
            yield batch

    def _epoch_batches(self, cursor: BlockCursor, size: int, epoch: int) -> Iterator[Any]:
        from dask_train.models._torch import model_inputs

        while True:
            if cursor.item is None and cursor.next_block(epoch) is None:
                return
            item = cursor.item
            assert item is not None and item.x is not None and item.y is not None
            order_x, order_y = _ordered(item)
            while cursor.consumed < item.rows:
                i = cursor.consumed
                xb, yb = order_x[i:i + size], order_y[i:i + size]
                cursor.take(len(xb))
                self.step += 1
                self._role.started()
                self._report_stats(cursor)
                x = model_inputs(np.ascontiguousarray(xb), self.device)
                if not self._run.labels:
                    yield x
                else:
                    yield x, _tensor(np.ascontiguousarray(yb), self.device)
            cursor.close_block(steps=cursor.batches)

    def _report_stats(self, cursor: BlockCursor, *, force: bool = False) -> None:
        """This rank's rows, batches and time waiting for data, once a second."""
        if self._stats is not None:
            self._stats.report(step=self.step, force=force, samples=cursor.samples,
                               steps=self.step, feed_wait_s=cursor.reader.wait_s, server_wait_s=0.0)

    def steps_per_epoch(self, batch_size: int | None = None) -> int:
        """The batches every rank takes in one epoch of ``ctx.batches(batch_size=...,
        even=True)`` when the ledger splits the blocks evenly over the ranks (each block's rows
        in batches of ``batch_size``, the last one of a block short): what a learning-rate
        schedule over epochs needs (``OneCycleLR(steps_per_epoch=...)``, Hugging Face's
        ``max_steps``). An estimate: the ledger places blocks where they live, and a rank that
        runs out takes one from another, so an epoch may take a few steps more. 0 without data.
        """
        size = self._run.batch_size if batch_size is None else int(batch_size)
        if size < 1:
            raise InvalidInput([f"ctx.steps_per_epoch(batch_size={batch_size!r}): use an "
                                "integer >= 1."])
        loads, steps = [0] * self.world_size, [0] * self.world_size
        for rows in sorted(self._run.block_rows, reverse=True):  # each to the least-loaded rank
            rank = min(range(self.world_size), key=lambda r: (loads[r], r))
            loads[rank] += rows
            steps[rank] += -(-rows // size)
        return max(steps, default=0)

    def dataset(self, name: str) -> Any:
        """A small named data set of ``dt.run(data=)`` whole, as tensors on :attr:`device`:
        ``(x, y)``, or ``x`` without targets (an evaluation set, say)."""
        from dask_train.models._torch import model_inputs

        if name not in self._run.small:
            raise InvalidInput([f"ctx.dataset({name!r}): the job's data sets are "
                                f"{sorted(self._run.small)} (and {self._run.train!r}, streamed "
                                "with ctx.batches)."])
        x, y = self._run.small[name]
        xt = model_inputs(x, self.device)
        return xt if y is None else (xt, _tensor(y, self.device))

    # -- reports, checkpoints, stopping ------------------------------------------------------------
    def report(self, metrics: Mapping[str, Any] | None = None, *, checkpoint: Any = None,
               reduce: str | None = None, sharded: bool = False) -> None:
        """Send scores (and a checkpoint) to the job; every rank calls it the same number of times.

        Parameters
        ----------
        metrics : mapping of str to number, optional
            Scores for the job's history, stop conditions and callbacks: rank 0's, or with
            ``reduce`` the ranks' combined.
        checkpoint : dict, optional
            The state to restart from: tensors, numpy arrays, numbers, strings and lists, tuples
            and dicts of them (``{"model": model.state_dict(), "opt": opt.state_dict()}``). Written
            (as safetensors and JSON, never a pickle) from the lowest rank that passes one, while
            every rank waits here, together with each rank's position in its data; pass it on rank
            0 only, or on every rank (the same state, as DDP keeps it).
        reduce : {None, "mean", "sum", "min", "max"}
            How the ranks' metrics are combined; None reports rank 0's.
        sharded : bool
            The state is split over the ranks (FSDP's ``get_state_dict``, ``DTensor``s, or
            ``Stateful`` objects): every rank passes its part, and writes it at once with
            ``torch.distributed.checkpoint`` (DCP) before the controller records the
            checkpoint; :meth:`restore` loads it back on any number of ranks.
        """
        if reduce not in REDUCTIONS:
            raise InvalidInput([f"ctx.report(reduce={reduce!r}): use one of {REDUCTIONS}."])
        values = numbers(metrics)
        self._reports += 1
        state = self._role.state
        written = self._write_sharded(checkpoint) if sharded else ""
        holds = bool(written) or not sharded and checkpoint is not None and self._hold(checkpoint)
        cursor = self._cursor
        event = Reported(
            trainer=self.rank, id=self._reports, steps=self.step,
            samples=0 if cursor is None else cursor.samples,
            position=None if cursor is None else cursor.position(), rng=rng_state(),
            next_epoch=self._restart_epoch(),
            metrics=values, checkpoint=holds, reduce=reduce, sharded=written)
        self._role.worker.log_event(self._role.config.topic, event.message())
        try:
            if not state.wait_resume(self._reports, timeout=self._role.config.timeout):
                self._stop = True  # stopped while every rank waited here: each sees it
        finally:
            if self._run.checkpointing:  # written to the store: not needed any more
                state.params.pop(0, None)

    def _hold(self, checkpoint: Any) -> bool:
        """Keep ``checkpoint`` where the controller's save finds it: for the job's store, or,
        without ``checkpoint=``, a copy until the next report, for a hand-over (a worker that
        leaves with notice, see :mod:`dask_train.controller.cluster._departures`) or for the survivors
        of a killed rank to go on from (``RunEngine.survivors``)."""
        if not self._run.checkpointing:
            self._say_no_store()
        from dask_train.checkpoint._state import flatten_state

        flatten_state(checkpoint)  # every problem named here, in the user's own call
        if not self._run.checkpointing:
            # Kept until the next report (a killed peer's job goes on from it): a copy, as a
            # state_dict's tensors are the live parameters training goes on changing.
            checkpoint = _kept(checkpoint)
        self._role.state.params[0] = StateHolder(
            checkpoint, steps=self.step, next_epoch=self._restart_epoch())
        return True

    def _say_no_store(self) -> None:
        if not self._said_no_store:
            self._said_no_store = True
            logger.info("rank %d: ctx.report(checkpoint=...) is not stored: the job has no "
                        "checkpoint=dt.CheckpointConfig(path)", self.rank)

    def _write_sharded(self, checkpoint: Any) -> str:
        """Every rank writes its part of ``checkpoint`` (DCP, a collective) where the controller
        adopts it; the directory, or "" when none is written."""
        import torch
        import torch.distributed as dist

        if self.world_size > 1:
            # DCP's save is a collective: a rank without a state would leave the others hanging.
            has = 1.0 if checkpoint is not None else 0.0
            both = torch.tensor([has, -has], dtype=torch.float64, device=self.device)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            if both[0].item() != -both[1].item():
                raise InvalidInput([f"ctx.report(checkpoint=..., sharded=True): rank {self.rank} "
                                    f"{'passed' if has else 'did not pass'} a state but not every "
                                    "rank did: each rank passes its part of a sharded state."])
        if checkpoint is None or not self._run.checkpointing:
            if checkpoint is not None:
                self._say_no_store()
            return ""
        path = f"{self._run.sharded_root}/{self._role.job}-r{self._reports}"
        save_sharded(checkpoint, path, options_of(self._run.sharded_root, None))
        return path

    def _restart_epoch(self) -> int:
        """The epoch a restart from here begins: this one, or the next once its batches are read."""
        return self._data_epoch

    def restore(self, state: Any = None) -> Any:
        """The state of the newest checkpoint this job (or the run resumed) wrote, as it was
        given to :meth:`report` (tensors on the CPU); None on a fresh start.

        A sharded checkpoint (``report(sharded=True)``) is loaded into ``state``, in place, as
        ``torch.distributed.checkpoint.load`` does: pass the same structure you report (a new
        FSDP model's ``get_state_dict``, or ``Stateful`` objects), on every rank; DCP splits it
        anew when the number of ranks changed. ``state`` is returned, or None on a fresh start.
        """
        info = self._restore_info
        sharded = None if info is None else info.get("sharded")
        if sharded:
            if state is None:
                raise InvalidInput(["ctx.restore(): the checkpoint is sharded (written with "
                                    "report(sharded=True)); pass the state to load it into, as "
                                    "you report it: ctx.restore({'model': ..., 'optim': ...})."])
            load_sharded(state, sharded["path"], options_of(self._run.sharded_root, None))
            return state
        if info is None or not info.get("files"):
            return None
        if state is not None:
            raise InvalidInput(["ctx.restore(state): the checkpoint is not sharded; call "
                                "ctx.restore() for the state as it was reported."])
        if self._restored is None:
            from dask_train.checkpoint._state import load_state

            self._restored = load_state(info["files"][0]["path"])
        return self._restored

    def should_stop(self) -> bool:
        """True once the job is stopping (a stop condition, a callback, the client).

        Decided at :meth:`report`, while every rank waits there, so every rank gets the same
        answer after the same report (a single rank also sees a stop at once).
        """
        if self.world_size == 1 and self._role.stopped():
            self._stop = True
        return self._stop

    def close(self) -> None:
        """Report the block being read, as far as it was read (the function returned)."""
        if self._cursor is not None:
            self._cursor.close_block(steps=self._cursor.batches)
            self._report_stats(self._cursor, force=True)
        if self._host is not None:
            self._host.close()
        self._drop_scratch()

    def abort(self) -> None:
        """This rank's own code raised: release the peers waiting for it in a host-memory sum
        (they fail at once, as over gloo when its process goes)."""
        if self._host is not None:
            self._host.abort()
        self._drop_scratch()

    def _drop_scratch(self) -> None:
        scratch, self._scratch = self._scratch, None
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


class StateHolder:
    """A reported checkpoint on its rank's worker, where the controller's save task finds it."""

    def __init__(self, state: Any, *, steps: int, next_epoch: int) -> None:
        self.state, self.steps, self.next_epoch = state, steps, next_epoch

    @property
    def version(self) -> int:
        """The reporting rank's steps at the report (a holder's update count)."""
        return self.steps

    def save(self, path: str, *, metadata: Mapping[str, str]) -> dict[str, Any]:
        """Write the state (safetensors and JSON); the record the controller's manifest reads."""
        from dask_train.checkpoint._state import save_state

        save_state(self.state, path, metadata={**metadata, "next_epoch": str(self.next_epoch)})
        return {"version": self.steps, "samples": 0, "finite": True}


def _kept(state: Any) -> Any:
    """A copy of a reported state that training cannot change: tensors copied to the CPU."""
    import copy

    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor)
                    else copy.deepcopy(v), state)


def _ordered(item: FeedItem) -> tuple[np.ndarray, np.ndarray]:
    """The block's rows in this epoch's order (each batch is then a slice of them)."""
    assert item.x is not None and item.y is not None
    if not item.shuffle:
        return item.x, item.y
    order = block_order(rows=item.rows, seed=item.seed, epoch=item.epoch, block=item.block,
                        shuffle=True)
    return item.x[order], item.y[order]


def _tensor(a: np.ndarray, device: Any) -> Any:
    import torch

    return torch.from_numpy(a).to(device)
