"""A job's events into its history: the engine's events (scores, non-finite losses, epochs,
stats, a ``dt.run`` report) become history records, progress, callbacks and the stop
conditions' decisions; and the stop itself, whatever decided it (a score, a non-finite loss, a
callback, a time limit, the trainers' natural end); at the job's end, the final score, and the
error of a job that made no finite step (:func:`no_finite_step`).

One object per job (:class:`JobHistory`), holding the queue the engine's events arrive on. The
controller's states ask it, in a generation's pass, to take the next event, make a callback's
stop, look at the time limits and stop when the trainers ended on their own; as the job ends, to
close the history (:meth:`JobHistory.final`) and say whether anything was trained
(:meth:`JobHistory.untrained`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from dask_train.controller._checkpointing import Restore
from dask_train.controller._hook_thread import CallbackThread
from dask_train.controller._publish import JobEvents
from dask_train.controller._reports import Reports
from dask_train.controller._state import JobLog, JobState, Phase
from dask_train.engines._events import (
    Epochs,
    Event,
    NonFinite,
    ReportReady,
    Score,
    Started,
    Stats,
)
from dask_train.engines._protocol import Ending, Engine
from dask_train.engines._spec import JobSpec
from dask_train.errors import NonFiniteLoss
from dask_train.policy.stop import check_stop

logger = logging.getLogger(__name__)


class JobHistory:
    """The events of one job into its history, its callbacks and its stop (see the module
    docstring).

    Parameters
    ----------
    spec : JobSpec
    log : JobLog
        Receives the history's records and the non-finite losses and scores.
    state : JobState
        Holds the stop (its reason, the step whose score decided it, a non-finite one).
    publisher : JobEvents
    callbacks : CallbackThread
    reports : Reports
        Takes a ``dt.run`` report every rank waits on.
    rows : int
        Training rows per epoch (for the history's epoch column).
    progress : Progress or None
    """

    def __init__(self, spec: JobSpec, *, log: JobLog, state: JobState, publisher: JobEvents,
                 callbacks: CallbackThread, reports: Reports, rows: int,
                 progress: Any = None) -> None:
        self.spec, self.log, self.state = spec, log, state
        self.publisher, self.callbacks, self.reports = publisher, callbacks, reports
        self.rows, self.progress = rows, progress
        self.events: asyncio.Queue[Event] = asyncio.Queue()  # the engine's, as they arrive
        # The current generation's engine keeps the parameters of each score (a flag of its
        # class; False until the first engine is made).
        self.keeps_scored = False

    async def take_event(self) -> None:
        """Wait a little for the engine's next event and take it in."""
        try:
            # A pause ends when its last trainer says so, which is no event here: look
            # again soon, the trainers wait meanwhile (an async-ps job's copies every 5 s,
            # each such a pause, cost it about 12% of its samples/s in one run).
            wait = 0.01 if self.state.phase is Phase.CHECKPOINTING else 0.2
            event = await asyncio.wait_for(self.events.get(), timeout=wait)
        except asyncio.TimeoutError:
            event = None
        if event is not None:
            self.on_event(event)

    def next_event(self) -> bool:
        """Take the next queued event, if any; False when none is queued."""
        if self.events.empty():
            return False
        self.on_event(self.events.get_nowait())
        return True

    def callback_stop(self) -> None:
        """A callback asked to stop (or its stop, withdrawn with a lost role, is made again:
        :meth:`JobState.withdraw_stop <._state.JobState.withdraw_stop>`)."""
        if self.callbacks.stop_asked() or self.state.callback_withdrawn:
            self.state.callback_withdrawn = False
            self.stop("callback")

    def check_time(self, now: float) -> None:
        """The stop conditions' time limits."""
        step = self.log.records[-1]["step"] if self.log.records else 0
        fired = check_stop(self.spec.stop, None, elapsed_s=self.log.elapsed(now), step=step)
        if fired is not None:
            self.stop(fired.describe())

    def trainers_ended(self, engine: Engine) -> None:
        """The engine's trainers ended on their own: the job stops for that, unless it stops
        already, or an event is left to read (a last score or NaN may say why it ended)."""
        if not self.state.stopped_by and self.events.empty():
            self.stop(self._natural_end(engine))

    def stop(self, reason: str) -> None:
        """Stop the job for ``reason`` (the first reason wins)."""
        if self.state.stop(reason):
            self.log.stop_at = time.time()
            logger.info("job %s stopping: %s", self.spec.job_id, reason)

    def final(self, ending: Ending) -> None:
        """The job's roles stopped with ``ending``: the trainers' last events taken in, and its
        final score closes the history. A score that stopped the job and whose parameters the
        engine kept makes them (and their buffers) ``ending``'s; a final score of the last
        parameters is the history's last record."""
        while self.next_event():
            pass
        final = ending.final
        if final is not None and final["params"] is not None:
            ending.params = final["params"]  # a score stopped the job: the parameters that earned it
            ending.buffers = final.get("buffers")  # and the buffers they were scored with
        elif final is not None and final["record"] is not None:
            # The final parameters' score closes the history: the result holds them (the
            # stopping score's snapshot, if there was one, was not kept).
            self.state.stop_step = None
            self.on_score(final["record"])

    def untrained(self, ending: Ending) -> NonFiniteLoss | None:
        """The error of a job that ended with ``ending`` without one finite step
        (:func:`no_finite_step`), None for any other job."""
        return no_finite_step(self.log.nonfinite, steps=ending.steps, on_nan=self.spec.on_nan)

    def continue_from(self, restore: Restore) -> None:
        """Continue the history, the clock and the stop conditions of a resumed job."""
        manifest = restore.manifest
        self.log.records.extend(manifest.get("records") or [])
        self.log.elapsed_before = float(manifest.get("elapsed_s", 0.0))
        self.state.last_checkpoint_step = restore.step
        for condition, saved in zip(self.spec.stop, manifest.get("stop") or []):
            if saved.get("type") == type(condition).__name__:
                condition.load_state_dict(saved.get("state") or {})

    # -- one event ----------------------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        """Take one of the engine's events in."""
        if isinstance(event, Started):
            self.log.first_step_at = self.log.first_step_at or time.time()
        elif isinstance(event, Score):
            self.on_score(event)
        elif isinstance(event, NonFinite):
            self._on_nan(event)
        elif isinstance(event, Epochs):
            while self.state.epochs_seen < event.completed:
                self.state.epochs_seen += 1
                last = self.log.records[-1] if self.log.records else None
                self.callbacks.call("on_epoch_end", self.state.epochs_seen,
                                    None if last is None else dict(last))
        elif isinstance(event, Stats):
            self.callbacks.call("on_stats", event.message())
        elif isinstance(event, ReportReady):
            self.reports.take(event)

    def _on_nan(self, event: NonFinite) -> None:
        role = f"trainer-{event.trainer}" if event.trainer >= 0 else "trainer"
        record = {"role": role, "step": event.step, "loss": event.loss, "epoch": event.epoch,
                  "block": event.block}
        self.log.nonfinite.append(record)
        self.publisher.publish({"kind": "nonfinite", **record})
        logger.warning("non-finite loss %s at step %d on %s", record["loss"], record["step"], role)
        if self.spec.on_nan == "stop":
            self.state.nan_stop = True
            self.stop(f"non-finite loss ({record['loss']}) at step {record['step']} on {role}")

    def on_score(self, event: Score) -> None:
        """A score: a history record, a progress update, callbacks and stop conditions."""
        if self.state.stop_step is not None and event.step > self.state.stop_step and \
                self.keeps_scored:
            # The scorer runs ahead of this loop on a loaded machine: scores of later steps may
            # be queued behind the one that stopped the job. The result holds the parameters of
            # the stopping score, so the history ends with it.
            logger.debug("score of step %d after the stop at step %d not recorded", event.step,
                         self.state.stop_step)
            return
        record = self._record(event)
        bad = list(event.nonfinite)
        if bad:
            self.log.nonfinite.append({"role": "scorer", "step": record["step"], "metrics": bad})
            self.publisher.publish({"kind": "nonfinite", **self.log.nonfinite[-1]})
            if self.spec.on_nan == "stop":
                self.state.nan_stop = True
                self.stop(f"non-finite score ({', '.join(bad)}) at step {record['step']}")
            return  # not recorded: stop conditions never see a NaN score
        self.log.records.append(record)
        self.publisher.publish({"kind": "record", **record})
        if self.progress is not None:
            self.progress.update(record)
        self.callbacks.call("on_score", dict(record))  # a True return stops at the next pass
        fired = check_stop(self.spec.stop, record, elapsed_s=record["time_s"], step=record["step"])
        if fired is not None:
            self.stop(fired.describe())
        if self.state.stopped_by and self.state.stop_step is None and fired is not None \
                and fired.max_step is None:
            self.state.stop_step = record["step"]

    def _record(self, event: Score) -> dict[str, Any]:
        now = self.log.elapsed()
        prev = self.log.records[-1] if self.log.records else {"time_s": 0.0, "samples": 0}
        span = now - prev["time_s"]
        rate = (event.samples - prev["samples"]) / span if span > 0 else math.nan
        return {"time_s": now, "step": event.step, "epoch": event.samples / self.rows,
                "samples": event.samples, "accuracy": math.nan, "loss": math.nan,
                **event.metrics, **({"worker": event.worker} if event.worker else {}),
                "samples_per_s": rate}

    def _natural_end(self, engine: Engine) -> str:
        if engine.epochs_completed() >= self.spec.epochs:
            return f"epochs={self.spec.epochs}"
        limits = [c for c in self.spec.stop if c.max_step is not None]
        return min(limits, key=lambda c: c.max_step or 0).describe() if limits else "trainers ended"


def no_finite_step(nonfinite: list[dict[str, Any]], *, steps: int,
                   on_nan: str) -> NonFiniteLoss | None:
    """The error of a job that ended without one finite step, None for any other job.

    ``nonfinite`` is the job's log of non-finite losses and scores (``JobLog.nonfinite``),
    ``steps`` the steps its parameters took (a resumed job's count those before the resume).
    A job with steps keeps its last good parameters, whatever came after them.
    """
    losses = [r for r in nonfinite if "loss" in r]  # scores' records name metrics instead
    if steps > 0 or not losses:
        return None
    first = losses[0]
    step, role, loss = int(first["step"]), str(first["role"]), str(first["loss"])
    block, epoch = int(first.get("block", -1)), int(first.get("epoch", -1))
    when = f", epoch {epoch}" if epoch >= 0 else ""
    where = f"block {block} of X (its row chunk {block}{when})" if block >= 0 else \
        f"a block not known{when}"
    if on_nan == "skip":
        what = (f"every batch's loss was non-finite and on_nan='skip' left each out; the first, "
                f"on {role} at step {step}, was {loss}, from {where}")
        fix = ("Clean the data (X or y holds NaN or inf: keep the rows where "
               "np.isfinite(X).all(axis=1)), or check the model and the loss: they give a "
               "non-finite loss before any step.")
    else:
        what = f"the first loss, on {role} at step {step}, was {loss}, from {where}"
        fix = ("Clean the data (X or y holds NaN or inf there: keep the rows where "
               "np.isfinite(X).all(axis=1)), or pass on_nan='skip' to leave batches whose loss "
               "is not finite out of the steps.")
    return NonFiniteLoss(f"the job made no finite step, so it has no trained parameters to "
                         f"return: {what}. {fix}", step=step, trainer=role, block=block,
                         epoch=epoch, loss=loss)
