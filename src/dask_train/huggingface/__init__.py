"""Hugging Face inside ``dt.run``: a ``transformers.Trainer`` (or your own loop with
``accelerate.Accelerator``) on every rank of the job.

``dt.run`` starts the ranks' process group and sets each rank's environment as ``torchrun`` does;
the ``Trainer`` and accelerate take the group as they find it (DDP over gloo, or NCCL on GPUs).
Four parts connect the ``Trainer`` to the job:

* :class:`Report`, a ``TrainerCallback``: what the ``Trainer`` logs and evaluates goes to
  ``ctx.report`` on every rank (the job's history, stop conditions, callbacks, TensorBoard, MLflow,
  the Training page); the job's stop ends training on every rank after the same step; with
  ``checkpoint=True`` each HF checkpoint is the job's.
* :func:`dataset`: the job's streamed data set (this rank's share of each epoch from the ledger,
  each row once per epoch over the ranks), or a small named set for evaluation.
* :func:`prepare_trainer`: makes the ``Trainer`` read that share as it is (accelerate would
  split it over the ranks again), one HF epoch per epoch of the job's data. Named after Ray
  Train's ``ray.train.huggingface.transformers.prepare_trainer``, which does the same for Ray Data.
* :func:`checkpoint_path`: after a lost worker ``dt.run`` starts every rank again; the job's
  newest checkpoint as the directory ``trainer.train(resume_from_checkpoint=...)`` takes.

:func:`from_dataset` turns a ``datasets.Dataset`` into ``dt.run`` training data read on the
workers. The parts load when first used: :func:`from_dataset`, in the client, imports neither
torch nor transformers; the others import transformers (``pip install dask-train[huggingface]``).
``import dask_train`` imports none of them.

Examples
--------
>>> from transformers import Trainer, TrainingArguments                      # doctest: +SKIP
>>> def train(ctx):                                                          # doctest: +SKIP
...     args = TrainingArguments(output_dir="out", per_device_train_batch_size=32,
...                              num_train_epochs=3, eval_strategy="epoch", save_strategy="epoch")
...     trainer = Trainer(model=make_model(), args=args,
...                       train_dataset=dt.huggingface.dataset(ctx),
...                       eval_dataset=dt.huggingface.dataset(ctx, "val"),
...                       callbacks=[dt.huggingface.Report(ctx, checkpoint=True)])
...     trainer = dt.huggingface.prepare_trainer(trainer)
...     trainer.train(resume_from_checkpoint=dt.huggingface.checkpoint_path(ctx))
"""

from __future__ import annotations

from dask_train._lazy import attach

__getattr__, __dir__, __all__ = attach(__name__, {
    "Report": "._report", "checkpoint_path": "._report", "dataset": "._data",
    "prepare_trainer": "._data", "from_dataset": "._datasets"})
