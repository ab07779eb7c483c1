"""The job's data for Hugging Face's ``Trainer``, on the ranks: the streamed set as this rank's
share, batch by batch (:func:`dataset`, :func:`prepare_trainer`), and the small sets as map-style
datasets."""

from __future__ import annotations

import math
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from transformers import TrainerCallback

from dask_train.errors import InvalidInput

#: A dataset's target columns that HF's ``default_data_collator`` passes to the model as ``labels``.
_TARGET_COLUMNS = ("label", "label_ids")


def _batch(x: Any, y: Any, *, inputs: str, labels: str) -> dict[str, Any]:
    """A batch as HF's models take it: the inputs by name, the targets as ``labels``."""
    batch = dict(x) if isinstance(x, Mapping) else {inputs: x}
    if y is None and labels not in batch:
        # A datasets.Dataset given to dt.run holds its targets as a column, often "label"
        # (load_dataset's): renamed as HF's default_data_collator renames it, since
        # prepare_trainer's batches skip that collator.
        column = next((c for c in _TARGET_COLUMNS if c in batch), None)
        y = None if column is None else batch.pop(column)
    if y is not None:
        # Classification heads take int64 class indices; the data may hold narrower integers.
        if not torch.is_floating_point(y) and y.dtype != torch.int64:
            y = y.long()
        batch[labels] = y
    return batch


class JobDataset(IterableDataset):  # type: ignore[type-arg]
    """The job's streamed data set for a ``Trainer``: this rank's share of each epoch from the
    job's ledger (``ctx.batches``), already split over the ranks, a batch at a time.

    Made by :func:`dataset`; the ``Trainer`` reads it through :func:`prepare_trainer`, which
    gives it the batches as they are (one epoch of the ledger per HF epoch). HF's own loader
    would split it over the ranks a second time (accelerate's ``IterableDatasetShard``, or
    ``dispatch_batches``, which reads it on rank 0 only), so iterating it directly raises.
    """

    def __init__(self, ctx: Any, name: str | None, *, inputs: str, labels: str) -> None:
        self.ctx, self.name, self.inputs, self.labels = ctx, name, inputs, labels
        self._epochs: Iterator[int] | None = None
        self.bound: int | None = None  # the epochs to read (None: the job's own bound)
        self.last_epoch = False  # the epoch being read is the last one HF asked for
        self.collate: Any = None

    def __len__(self) -> int:
        """The rows of one epoch over all ranks (what HF checks a dataset for; the steps come
        from :func:`prepare_trainer`)."""
        return int(sum(self.ctx._run.block_rows))

    def __iter__(self) -> Iterator[Any]:
        raise InvalidInput(["dt.huggingface.dataset(ctx) is this rank's share of the job's data, "
                            "split over the ranks already: pass the Trainer through "
                            "trainer = dt.huggingface.prepare_trainer(trainer) before "
                            "trainer.train(), so that it reads it as it is (HF's own loader "
                            "would split it again, or read it on rank 0 only)."])

    def start(self, epochs: int | None) -> None:
        """Read up to ``epochs`` epochs (the job's own bound when None), from the one a restart
        resumes (``ctx.epochs``: the checkpoint's)."""
        bound = epochs if epochs is not None else self.ctx._run.epochs
        self._epochs = iter(self.ctx.epochs(bound if bound is not None else 1_000_000_000))
        self.bound = bound

    def epoch(self, batch_size: int) -> Iterator[dict[str, Any]]:
        """One epoch of this rank's batches, as HF's models take them; nothing once the epochs
        are done or the job stopped. Every rank gets as many batches (``even=True``): HF's DDP
        steps are collectives."""
        if self._epochs is None:
            self.start(None)
        assert self._epochs is not None
        epoch = next(self._epochs, None)
        if epoch is None:
            return
        self.last_epoch = self.bound is not None and epoch + 1 >= self.bound
        for item in self.ctx.batches(self.name, batch_size=batch_size, even=True):
            x, y = item if isinstance(item, tuple) else (item, None)
            batch = _batch(x, y, inputs=self.inputs, labels=self.labels)
            yield batch if self.collate is None else self.collate(_rows(batch))


class _Epoch(IterableDataset):  # type: ignore[type-arg]
    """One pass of a :class:`JobDataset` at the ``Trainer``'s batch size (no length: a
    streamed epoch's batches are known once it is read)."""

    def __init__(self, data: JobDataset, batch_size: int) -> None:
        self.data, self.batch_size = data, batch_size

    def __iter__(self) -> Iterator[Any]:
        return self.data.epoch(self.batch_size)


class _Rows(Dataset):  # type: ignore[type-arg]
    """A small named set of the job, whole, as rows of HF's models' inputs (map-style: HF
    splits it over the ranks to evaluate, and gathers the predictions)."""

    def __init__(self, x: Any, y: Any, *, inputs: str, labels: str) -> None:
        batch = _batch(x, y, inputs=inputs, labels=labels)
        # On the host: HF's loader pins each batch (dataloader_pin_memory) and moves it to its
        # device itself, and a GPU tensor cannot be pinned (ctx.dataset's are on ctx.device).
        self.batch = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        self.n = int(next(iter(self.batch.values())).shape[0])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: v[i] for k, v in self.batch.items()}


def _rows(batch: Mapping[str, Any]) -> list[dict[str, Any]]:
    n = int(next(iter(batch.values())).shape[0])
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def dataset(ctx: Any, name: str | None = None, *, inputs: str = "input_ids",
            labels: str = "labels") -> Any:
    """A data set of the ``dt.run`` job that HF's ``Trainer`` takes.

    The streamed set (the first of ``dt.run(data=)``, the default): this rank's share of each
    epoch from the job's ledger, each row once per epoch over all ranks, shuffled per epoch from
    ``dt.run(seed=)``, as ``ctx.batches`` reads it; pass the ``Trainer`` through
    :func:`prepare_trainer`. Another named set: the whole set on every rank as a map-style
    dataset of rows (an ``eval_dataset``: HF splits it over the ranks and gathers the
    predictions).

    Rows are dicts of the model's inputs: ``X`` under ``inputs`` (``input_ids``), or a dict of
    inputs under their own names (``{"input_ids": ..., "attention_mask": ...}``: a
    ``datasets.Dataset`` given to ``dt.run`` is its columns so), and the targets under
    ``labels``, as HF's models take them (integer targets as int64; a ``label`` or ``label_ids``
    column is renamed ``labels``, as HF's ``default_data_collator`` does).

    Parameters
    ----------
    ctx : RunContext
    name : str, optional
        A data set of ``dt.run(data=)``; the streamed one by default.
    inputs : str
        The name of a single input array.
    labels : str
        The name of the targets.

    Examples
    --------
    >>> trainer = Trainer(model, args, train_dataset=dt.huggingface.dataset(ctx),
    ...                   eval_dataset=dt.huggingface.dataset(ctx, "val"))  # doctest: +SKIP
    >>> trainer = dt.huggingface.prepare_trainer(trainer)                     # doctest: +SKIP
    """
    run = getattr(ctx, "_run", None)
    if run is None or not callable(getattr(ctx, "batches", None)):
        raise InvalidInput([f"dataset(ctx={ctx!r}): pass the ctx your dt.run function received."])
    if name is None or name == run.train:
        if run.train is None:
            raise InvalidInput(["dt.huggingface.dataset(ctx): the job was given no data=; pass "
                                "dt.run(data={'train': (X, y)})."])
        return JobDataset(ctx, run.train, inputs=inputs, labels=labels)
    got = ctx.dataset(name)
    x, y = got if isinstance(got, tuple) else (got, None)
    return _Rows(x, y, inputs=inputs, labels=labels)


def prepare_trainer(trainer: Any) -> Any:
    """Make a ``transformers.Trainer`` read the job's streamed data set as it is; returns it.

    When ``trainer.train_dataset`` is :func:`dataset`'s streamed set:

    * the ``Trainer``'s training loader is a plain ``DataLoader`` over this rank's batches
      (``ctx.batches(batch_size=per_device_train_batch_size, even=True)``), not one accelerate
      splits over the ranks again: each row is read once per epoch over the ranks, and every
      rank takes as many steps (HF's DDP steps are collectives). One HF epoch is one epoch of the
      job's ledger.
    * a streamed set has no length, so HF counts steps, not epochs: with ``max_steps`` unset,
      it is ``num_train_epochs`` epochs of :meth:`~RunContext.steps_per_epoch` batches (for the
      learning-rate schedule), and training ends after ``num_train_epochs`` epochs of the data.
    * ``ignore_data_skip=True``: on resume HF would skip the resumed epoch's first batches; the
      job's ledger already goes on from the rows the checkpoint had not read.

    Any other ``Trainer`` is returned as it is. Like Ray Train's ``prepare_trainer``, it keeps
    the ``Trainer``'s class and everything else about it.

    Examples
    --------
    >>> trainer = dt.huggingface.prepare_trainer(Trainer(model, args,
    ...     train_dataset=dt.huggingface.dataset(ctx)))                       # doctest: +SKIP
    """
    data = getattr(trainer, "train_dataset", None)
    if not isinstance(data, JobDataset):
        return trainer
    from transformers import default_data_collator
    from transformers.data.data_collator import DataCollatorWithPadding

    args = trainer.args
    epochs = None
    if args.max_steps is None or args.max_steps <= 0:
        per_epoch = data.ctx.steps_per_epoch(args.per_device_train_batch_size)
        epochs = max(1, math.ceil(args.num_train_epochs))
        args.max_steps = max(1, math.ceil(
            args.num_train_epochs * per_epoch / max(1, args.gradient_accumulation_steps)))
    args.ignore_data_skip = True
    data.start(epochs)
    # The batches are collated already (stacked rows of fixed-width arrays); a collator of the
    # user's own (masking for a language model, say) still sees rows.
    collator = trainer.data_collator
    if collator is not default_data_collator and not isinstance(collator, DataCollatorWithPadding):
        data.collate = collator

    def get_train_dataloader(self: Any) -> DataLoader:
        # batch_size=None: the items are batches. Not passed to accelerator.prepare, which
        # would split this rank's share over the ranks again; HF moves each batch to its device.
        return DataLoader(_Epoch(self.train_dataset, self._train_batch_size), batch_size=None)

    trainer.get_train_dataloader = types.MethodType(get_train_dataloader, trainer)
    trainer.add_callback(_LastEpoch(data))
    return trainer


class _LastEpoch(TrainerCallback):
    """Ends training after the last epoch the ``Trainer`` asked for (HF counts steps for a
    streamed set; every rank ends the same epoch together)."""

    def __init__(self, data: JobDataset) -> None:
        self.data = data

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.data.last_epoch:
            control.should_training_stop = True
        return control
