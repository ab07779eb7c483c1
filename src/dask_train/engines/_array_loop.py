"""The chief's loop for an :class:`~dask_train.models.ArrayModel`: numpy sync training.

The tasks it submits (one per group of co-located blocks, plus a scorer) are in
:mod:`dask_train.engines.sync_array`; this module drives them from the client: sends the
parameters, tree-reduces the partial sums on the workers, applies the mean gradient with a torch
optimizer, and runs scores, stop conditions and callbacks as for every other strategy.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from distributed import Client, Future

from dask_train.classical.full_batch import BlockData, add_terms, send_params, tree_reduce
from dask_train.engines.sync_array import group_step, score_task
from dask_train.models._array import ArrayModel
from dask_train.models._torch import build_optimizer
from dask_train.policy.callbacks import Callback, run_callbacks
from dask_train.policy.stop import StopCondition, check_stop


@dataclass(frozen=True)
class ArrayJob:
    """The Trainer's settings that the numpy sync loop uses."""

    optimizer: str
    lr: float
    optimizer_options: dict[str, Any]
    batch_size: int
    grad_accumulation: int
    epochs: int
    shuffle: bool
    seed: int
    score_every: float
    stop: Sequence[StopCondition]
    callbacks: Sequence[Callback]
    on_nan: str
    split_every: int = 2


@dataclass
class ArrayRun:
    """What the loop hands back to ``Trainer.fit``."""

    model: ArrayModel
    records: list[dict[str, Any]]
    stopped_by: str
    steps: int
    samples: int
    epochs_completed: int
    ledger: list[dict[str, Any]]
    trainers: list[dict[str, Any]]
    placement: dict[str, list[str]]
    nonfinite: list[dict[str, Any]] = field(default_factory=list)


class _Scorer:
    """At most one scoring task in flight; its records in the order they were asked for."""

    def __init__(self, client: Client, model: ArrayModel, validation: Any) -> None:
        self.client, self.model = client, model
        # One object, not one future per array: the scorer's task takes the pair together.
        self.ref = None if validation is None else client.scatter([validation], direct=True)[0]
        self.pending: tuple[Future, dict[str, Any], np.ndarray] | None = None

    def ask(self, params: np.ndarray, meta: dict[str, Any]) -> None:
        if self.ref is None or self.pending is not None:
            return
        future = self.client.submit(score_task, self.model.loss_grad, self.model.predict,
                                    params, self.ref, pure=False)
        self.pending = (future, meta, params)

    def ready(self, *, block: bool = False) -> tuple[dict[str, Any], dict[str, float],
                                                      np.ndarray] | None:
        """(meta, scores, parameters scored) of the task in flight once it is done."""
        if self.pending is None or (not block and not self.pending[0].done()):
            return None
        future, meta, params = self.pending
        self.pending = None
        return meta, future.result(), params

    @property
    def worker(self) -> list[str]:
        """Where the validation data (and so the scoring) lives."""
        if self.ref is None:
            return []
        return sorted(self.client.who_has([self.ref]).get(self.ref.key, ()))[:1]


class ArrayLoop:
    """The chief's training loop for an ArrayModel (see :func:`start_array_sync`)."""

    def __init__(self, client: Client, model: ArrayModel, data: BlockData, job: ArrayJob,
                 validation: Any, progress: Any) -> None:
        self.client, self.model, self.data, self.job, self.progress = (
            client, model, data, job, progress)
        self.groups = data.groups()
        self.group_rows = [sum(data.rows[i] for i in g) for g in self.groups]
        self.rows_per_step = job.batch_size * job.grad_accumulation
        self.steps_per_epoch = max(math.ceil(r / self.rows_per_step) for r in self.group_rows)
        self.param = torch.nn.Parameter(torch.from_numpy(model.params.copy()))
        self.grad = torch.zeros_like(self.param)
        self.param.grad = self.grad
        self.optimizer = build_optimizer(job.optimizer, [self.param], lr=job.lr,
                                         options=job.optimizer_options)
        self.scorer = _Scorer(client, model, validation)
        self.records: list[dict[str, Any]] = []
        self.nonfinite: list[dict[str, Any]] = []
        self.ledger: list[dict[str, Any]] = []
        self.step = self.samples = self.epochs_done = 0
        self.stopped_by = ""
        self.best: np.ndarray | None = None  # the parameters a score-based stop returns
        self.started = time.monotonic()
        self.last_score = self.started

    def elapsed(self) -> float:
        """Seconds since the loop was set up."""
        return time.monotonic() - self.started

    def run(self) -> None:
        """Train until the epochs end or a stop condition, callback or non-finite loss ends it."""
        for epoch in range(self.job.epochs):
            consumed = [0] * len(self.groups)
            for s in range(self.steps_per_epoch):
                fired = check_stop(self.job.stop, None, elapsed_s=self.elapsed(), step=self.step)
                if fired is not None:
                    self.stopped_by = fired.describe()
                elif self._step(epoch, s, consumed):
                    self._poll_scores()
                if self.stopped_by:
                    break
            self.ledger += [{"epoch": epoch, "trainer": g, "rows": self.group_rows[g],
                             "consumed": consumed[g]} for g in range(len(self.groups))]
            if self.stopped_by:
                break
            self.epochs_done += 1
            last = self.records[-1] if self.records else None
            if run_callbacks(self.job.callbacks, "on_epoch_end", epoch + 1, last):
                self.stopped_by = "callback"
                break
        self.stopped_by = self.stopped_by or f"epochs={self.job.epochs}"
        self._final_score()

    def _step(self, epoch: int, s: int, consumed: list[int]) -> bool:
        """One update; False when it was left out (a non-finite loss with on_nan='skip')."""
        # A copy: the optimizer changes the parameters in place while the message may be queued.
        params = self.param.detach().numpy().copy()
        ref = send_params(self.client, params, copies=len(self.groups))
        parts = [
            self.client.submit(
                group_step, self.model.loss_grad, ref,
                (self.job.seed, epoch, s, self.rows_per_step, g, int(self.job.shuffle)),
                *[self.data.futures[i] for i in group], pure=False)
            for g, group in enumerate(self.groups)
        ]
        if len(parts) <= self.job.split_every:
            # A tree of one combine task would move the same bytes to one place, one task
            # round trip later: fetch the partials and add them here, in the same order.
            results = self.client.gather(parts, direct=True)
            loss, grad, rows = functools.reduce(add_terms, results)
        else:
            total = tree_reduce(parts, add_terms, self.job.split_every, client=self.client)
            loss, grad, rows = self.client.gather(total, direct=True)
        for g, group_rows in enumerate(self.group_rows):
            consumed[g] = min(group_rows, (s + 1) * self.rows_per_step)
        if not (math.isfinite(loss) and np.isfinite(grad).all()):
            self.nonfinite.append({"role": "worker", "step": self.step, "loss": loss,
                                   "epoch": epoch, "block": -1})
            if self.job.on_nan == "stop":
                self.stopped_by = f"non-finite loss ({loss}) at step {self.step}"
            return False
        self.grad.copy_(torch.from_numpy(grad / rows))
        self.optimizer.step()
        self.step += 1
        self.samples += int(rows)
        now = time.monotonic()
        if now - self.last_score >= self.job.score_every:
            self.last_score = now
            self.scorer.ask(self.param.detach().numpy().copy(), self._meta())
        return True

    def _meta(self) -> dict[str, Any]:
        return {"time_s": self.elapsed(), "step": self.step, "samples": self.samples,
                "epoch": self.samples / max(1, sum(self.group_rows))}

    def _poll_scores(self, *, block: bool = False) -> None:
        got = self.scorer.ready(block=block)
        if got is None:
            return
        meta, scores, params = got
        bad = [name for name, value in scores.items() if not math.isfinite(value)]
        prev = self.records[-1] if self.records else {"time_s": 0.0, "samples": 0}
        span = meta["time_s"] - prev["time_s"]
        rate = (meta["samples"] - prev["samples"]) / span if span > 0 else math.nan
        record = {**meta, "accuracy": math.nan, **scores, "samples_per_s": rate}
        if bad:
            self.nonfinite.append({"role": "scorer", "step": record["step"], "metrics": bad})
            if self.job.on_nan == "stop" and not self.stopped_by:
                self.stopped_by = f"non-finite score ({', '.join(bad)}) at step {record['step']}"
            return
        self.records.append(record)
        if self.progress is not None:
            self.progress.update(record)
        if run_callbacks(self.job.callbacks, "on_score", record):
            self.stopped_by = self.stopped_by or "callback"
        fired = check_stop(self.job.stop, record, elapsed_s=self.elapsed(), step=self.step)
        if fired is not None and not self.stopped_by:
            self.stopped_by = fired.describe()
            if fired.max_step is None:
                self.best = params  # the parameters that earned the score

    def _final_score(self) -> None:
        if self.scorer.pending is not None:
            self._poll_scores(block=True)
        if self.best is None and self.scorer.ref is not None and (
                not self.records or self.records[-1]["step"] != self.step):
            # stopped_by is set by now, so this last score cannot change why the job ended.
            self.scorer.ask(self.param.detach().numpy().copy(), self._meta())
            self._poll_scores(block=True)

    @property
    def placement(self) -> dict[str, list[str]]:
        """Role kind -> workers: a trainer per group of co-located blocks, and the scorer."""
        return {"worker": [self.data.holders[g[0]] for g in self.groups],
                "scorer": self.scorer.worker}

    def result(self) -> ArrayRun:
        """The trained model (the scored parameters when a score stopped the job) and counters."""
        params = self.best if self.best is not None else self.param.detach().numpy().copy()
        placement = self.placement
        trainers = [{"trainer": g, "worker": placement["worker"][g], "rows": self.group_rows[g],
                     "steps": self.step} for g in range(len(self.groups))]
        return ArrayRun(model=replace(self.model, params=params), records=self.records,
                        stopped_by=self.stopped_by, steps=self.step, samples=self.samples,
                        epochs_completed=self.epochs_done, ledger=self.ledger, trainers=trainers,
                        placement=placement, nonfinite=self.nonfinite)


def start_array_sync(client: Client, model: ArrayModel, data: BlockData, job: ArrayJob,
                     validation: tuple[np.ndarray, np.ndarray] | None,
                     progress: Any = None) -> ArrayLoop:
    """Set up the loop that trains ``model`` on the persisted ``data``; ``run()`` trains.

    Parameters
    ----------
    client : distributed.Client
    model : ArrayModel
    data : BlockData
        The training blocks, persisted where they will stay (:func:`persist_data`).
    job : ArrayJob
    validation : (numpy.ndarray, numpy.ndarray) or None
        Scored in the background every ``job.score_every`` seconds and once at the end.
    progress : Progress, optional
        Updated with each score.

    Returns
    -------
    ArrayLoop
        ``placement`` tells where the roles are; ``run()`` trains until the epochs end or a
        condition stops it; ``result()`` is the outcome.
    """
    return ArrayLoop(client, model, data, job, validation, progress)
