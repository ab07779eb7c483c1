"""The ``TrainerCallback`` that connects Hugging Face's ``Trainer`` to its ``dt.run`` job, and the
path a restarted rank resumes from (see the package docstring)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import TrainerCallback

from dask_train.engines.run.metrics import check_report_options, logged_numbers
from dask_train.huggingface import _checkpoint

logger = logging.getLogger(__name__)


class Report(TrainerCallback):
    """Send what the ``Trainer`` logs and evaluates to the ``dt.run`` job; stop it when the job
    stops; with ``checkpoint=True``, make each of its checkpoints the job's.

    HF's ``Trainer`` logs, evaluates and saves at the same global steps on every rank (its
    ``logging_steps``, ``eval_strategy`` and ``save_strategy``), with the loss and the evaluation
    metrics already gathered over the ranks. What one step logs, evaluates and saves goes to the
    job as one ``ctx.report`` at the last of those events, on every rank, so every rank reports
    the same number of times: the metrics reach the job's history, stop conditions, callbacks,
    TensorBoard, MLflow and the Training page. When the job stops (a stop condition, a callback,
    the client), every rank learns it at the same report and sets
    ``control.should_training_stop``: HF ends training after that step on every rank, and no rank
    is left in a collective the others have left. The history's ``step`` is the batches each rank
    read (HF's ``global_step`` with ``gradient_accumulation_steps=1``); HF's fractional
    ``epoch`` is not reported (the history has the job's own).

    With ``checkpoint=True`` each HF checkpoint (``save_strategy``) is also the job's: the files
    the ``Trainer`` wrote on rank 0 (weights, optimizer, scheduler and trainer state), with
    every rank's RNG state, are reported with that step's metrics and written by the job as any
    ``dt.run`` checkpoint (safetensors and JSON, no pickle) with every rank's place in the data.
    After a lost worker, :func:`checkpoint_path` hands them back to
    ``trainer.train(resume_from_checkpoint=...)``.

    Parameters
    ----------
    ctx : RunContext
        The rank's context (``dt.run``'s first argument to your function).
    metrics : sequence of str, optional
        Only these logged names; all of them by default.
    reduce : {None, "mean", "sum", "min", "max"}
        As ``ctx.report``; HF's logged values are equal on every rank already.
    checkpoint : bool
        Report HF's checkpoint at each save (the job needs ``checkpoint=dt.CheckpointConfig``).

    Examples
    --------
    >>> trainer = Trainer(model, args, train_dataset=dt.huggingface.dataset(ctx),
    ...                   callbacks=[dt.huggingface.Report(ctx, checkpoint=True)])  # doctest: +SKIP
    """

    def __init__(self, ctx: Any, *, metrics: Sequence[str] | None = None,
                 reduce: str | None = None, checkpoint: bool = False) -> None:
        check_report_options(ctx, metrics, reduce, checkpoint)
        self.ctx, self.reduce, self.checkpoint = ctx, reduce, checkpoint
        self.metrics = None if metrics is None else list(metrics)
        self.pending: dict[str, float] = {}
        self.reports = 0

    # -- HF's events: each step's log, evaluation and save end in one report -----------------------
    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
               **kwargs: Any) -> Any:
        """Keep the logged numbers; report them unless this step still evaluates or saves."""
        self._keep(logs)
        # HF clears should_evaluate and should_save once each is done (an evaluation logs
        # before it clears should_evaluate): the last event of the step reports.
        if not (control.should_evaluate or control.should_save):
            return self._report(state, control)
        return None

    def on_evaluate(self, args: Any, state: Any, control: Any,
                    metrics: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        """Report the evaluation's metrics (logged just before) unless this step still saves."""
        if not control.should_save:
            return self._report(state, control)
        return None

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Report the step, with HF's checkpoint of it when ``checkpoint=True``."""
        saved = None
        if self.checkpoint and not self.ctx.should_stop():
            directory = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            # Every rank's RNG file (each rank writes its own, in its own output_dir) goes to
            # rank 0, which reports the checkpoint: a resumed rank draws as it would have.
            rngs = _checkpoint.gather_to_first(_checkpoint.rng_files(directory, self.ctx.rank))
            if self.ctx.rank == 0 and os.path.isdir(directory):
                saved = _checkpoint.capture(directory)
                for files in rngs:
                    saved["files"].update(files)
            elif self.ctx.rank == 0:  # a save HF made elsewhere (a hyper-parameter trial's)
                logger.info("Report: no checkpoint at %s to report", directory)
        return self._report(state, control, checkpoint=saved, always=self.checkpoint)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Stop once the job stops (decided at a report, so on every rank at the same step)."""
        if self.ctx.should_stop():
            control.should_training_stop = True
            return control
        return None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Report what is left (the end of training's summary)."""
        if self.pending:
            self._report(state, control)
        return None

    # -- the report ---------------------------------------------------------------------------------
    def _keep(self, values: Mapping[str, Any] | None) -> None:
        self.pending.update(logged_numbers(values, self.metrics))

    def _report(self, state: Any, control: Any, *, checkpoint: Any = None,
                always: bool = False) -> Any:
        """One ``ctx.report`` on every rank (each rank took the same decisions to get here)."""
        if self.ctx.should_stop():
            # Stopped at an earlier report: HF is winding down; the job records no more.
            self.pending.clear()
            control.should_training_stop = True
            return control
        if not self.pending and not always:
            return None
        values, self.pending = self.pending, {}
        self.ctx.report(values, reduce=self.reduce, checkpoint=checkpoint)
        self.reports += 1
        if self.ctx.should_stop():
            control.should_training_stop = True
        return control


def checkpoint_path(ctx: Any) -> str | None:
    """The job's newest checkpoint as a Hugging Face checkpoint directory for
    ``trainer.train(resume_from_checkpoint=...)``, or None on a fresh start (HF starts from
    scratch).

    The files :class:`Report` reported (``checkpoint=True``) are written back into a new
    directory in ``ctx.scratch_dir``, on this rank's worker and removed when the function returns
    (``torch.save`` of the tensors and plain values the job read
    back, which HF loads with ``weights_only=True``): HF restores the weights, the optimizer, the
    scheduler and its ``TrainerState`` (the global step goes on from the checkpoint's), and
    :func:`dataset` goes on from the rows the ledger had not given out, so every row is still read
    once per epoch.

    Examples
    --------
    >>> trainer.train(resume_from_checkpoint=dt.huggingface.checkpoint_path(ctx))  # doctest: +SKIP
    """
    state = ctx.restore()
    if state is None:
        return None
    _checkpoint.check(state)
    return _checkpoint.rebuild(state, ctx.scratch_dir)
