"""What ``Trainer.fit`` returns."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dask_train.api._job_result import JobResult
from dask_train.errors import InvalidInput

if TYPE_CHECKING:  # annotations only: pandas loads when a result is built (0.45 s of start-up)
    import torch  # and torch where a prediction needs it: `dt.run` needs none (1 s of start-up)

    from dask_train.models import ArrayModel


@dataclass(kw_only=True)
class FitResult(JobResult):
    """The outcome of a training job.

    Attributes
    ----------
    model : torch.nn.Module, keras.Model or ArrayModel
        The trained module, with the parameters pulled from the servers (for a
        :class:`~dask_train.models.ArrayModel`, a copy holding the trained parameters; for a
        Keras model, a copy of it with the trained weights).
    history : pandas.DataFrame
        One row per score: ``time_s, step, epoch, samples, accuracy, loss, samples_per_s``.
    stopped_by : str
        What ended the job, e.g. ``"StopAtScore(accuracy>=0.97)"`` or ``"epochs=3"``.
    steps, samples : int
        Updates applied by the servers and samples they were computed on.
    epochs_completed : int
        Epochs whose every block was consumed in full.
    wall_s : float
        Seconds from the first role's start to the end of the job.
    ledger : pandas.DataFrame
        One row per (epoch, block) handed out: trainer, rows, rows consumed, local or moved.
        ``consumed`` counts every row of the block applied to the parameters, those a lost
        trainer or an earlier generation applied included (``skip``), so its sum is the
        samples the parameters have seen.
    roles : Roles
        Where each role ran.
    trainers : list of dict
        Each trainer's own count of steps and samples.
    failures : list of dict
        Each lost or failed role: when, which worker, the cause and what the job did about it;
        ``loss`` numbers the losses (roles of one lost worker share it), which ``max_failures``
        counts; a restart's ``redone`` is how many samples the ledger had seen applied since
        the checkpoint it restarts from (or since the start), which are trained again.
        ``notice`` is True for a worker that left with notice while the job started or
        stopped (no hand-over is made then): acted on as a loss, but ``loss`` is None and
        ``max_failures`` does not count it.
    checkpoints : list of dict
        Each checkpoint written: directory, step, seconds to write.
    departures : list of dict
        Each worker that left with notice (retired, scaled down, its ``--lifetime`` over) while
        it held roles: which worker and roles, the step the job handed over at, the seconds from
        the notice to the next generation's start (``hand_over_s``), ``redone`` (0) and the
        ``directory`` the state went through (a checkpoint of ``checkpoint=``, else one kept in
        memory and removed at the end: in ``/dev/shm``, or ``dask-train-workers://`` in other
        workers' memory). Not a failure: ``max_failures`` does not count it. See
        :doc:`/cluster-changes`.
    arrivals : list of dict
        Each regroup of a sync job onto workers that joined (a scale-up), with the same fields:
        the job paused, its state was written and its ranks started again on every worker.
    nonfinite : list of dict
        Non-finite losses and scores seen (role, step).
    model_step : int
        The step whose parameters ``model`` holds: the scored step when a score stopped the job
        (the servers may have gone a few asynchronous steps further, see ``steps``), else
        ``steps``.
    generations : int
        1, plus one per restart from a checkpoint.
    validation_rows : dict
        Where the last score's validation rows were evaluated: worker address -> rows. One
        worker (the scorer's) for a validation set in memory; every worker holding blocks for a
        dask one, which never leaves the cluster.
    timings : dict
        Seconds spent in each phase of the fit: ``connect`` (starting the embedded cluster, 0
        with a given one), ``persist`` (the data onto the workers), ``roles`` (placing roles,
        starting servers, trainers and scorer), ``first_step`` (until the first update),
        ``train`` (from the first update until a stop was decided), ``teardown`` (the final
        score, pulling the model, the final checkpoint, cleaning up) and ``total`` (the whole
        ``fit`` call, argument checks included).
    started_at : float
        Wall-clock time (``time.time()``) when training started: the origin of ``history.time_s``
        and of ``StopAfter`` (placing the roles counts; persisting the data does not). A resumed
        job's ``time_s`` goes on from the checkpoint's.
    plan : dict
        How the job ran: ``strategy`` (the engine), ``workers`` and ``ps``; with
        ``strategy="auto"`` also ``chosen`` (``"one-process"``, ``"sync"`` or ``"async-ps"``),
        ``predicted_samples_per_s`` and ``bottlenecks`` of every candidate, and ``probe_s``
        (the seconds measuring the costs took); with ``ps="auto"`` the prediction of the count
        chosen.
    scorer : dict
        What the scorer spent: ``cpu_s`` (CPU seconds scoring: its own thread's, and where the
        validation blocks were evaluated), ``share`` (``cpu_s`` over ``wall_s``: the cores it
        took, on average), ``budget`` (the share of one core allowed, None for no limit),
        ``scores`` taken, ``skipped`` (due by ``score_every`` but left out to keep within
        the budget) and ``unchanged`` (due, but the parameters were those scored last: not
        scored again). Empty without a scorer.
    """

    model: torch.nn.Module | ArrayModel | Any
    trainers: list[dict[str, Any]] = field(default_factory=list)
    nonfinite: list[dict[str, Any]] = field(default_factory=list)
    model_step: int = -1
    validation_rows: dict[str, int] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    scorer: dict[str, Any] = field(default_factory=dict)

    def _last(self, column: str) -> float:
        if column not in self.history or self.history[column].dropna().empty:
            return math.nan
        return float(self.history[column].dropna().iloc[-1])

    def summary(self) -> dict[str, Any]:
        """Final scores and counters as a JSON-able dict (what ``dask-train demo`` writes)."""
        return {
            "accuracy": self._last("accuracy"),
            "loss": self._last("loss"),
            "steps": int(self.steps),
            "samples": int(self.samples),
            "samples_per_s": float(self.samples_per_s),
            "wall_s": float(self.wall_s),
            "epochs_completed": int(self.epochs_completed),
            "stopped_by": self.stopped_by,
            # What ran: "one-process", "sync" or "async-ps" ("auto"'s choice, else as asked).
            **({"strategy": self.plan.get("chosen", self.plan.get("strategy"))}
               if self.plan else {}),
        }

    def predict(self, X: Any, *, batch_size: int = 4096) -> Any:
        """The trained model's outputs on ``X``, computed here (a dask input is computed first).

        For a torch module: its outputs in eval mode, batch by batch, as a numpy array (class
        scores for a classifier: take ``argmax(axis=1)`` for labels); for a Keras model, its
        outputs with ``training=False``. For an ArrayModel: its
        ``predict(params, X)``. For predictions over a large dask collection on the cluster, see
        the prediction API.
        """
        from dask_train.data._inputs import is_collection
        from dask_train.models._frameworks import is_keras_model

        x = np.asarray(X.compute() if is_collection(X) else X)

        if is_keras_model(self.model):
            from dask_train.models._frameworks import keras_float_dtype
            from dask_train.models._keras_eval import predict

            x = x.astype(keras_float_dtype(self.model), copy=False) if x.dtype.kind == "f" else x
            return predict(self.model, x, batch_size=batch_size)
        import torch

        if not isinstance(self.model, torch.nn.Module):
            if self.model.predict is None:
                raise InvalidInput(["this ArrayModel has no predict function: pass "
                                    "predict= to dt.ArrayModel to use result.predict."])
            return np.asarray(self.model.predict(self.model.params, x))
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), None)
        if x.dtype.kind == "f" and dtype is not None:
            x = x.astype(str(dtype).removeprefix("torch."), copy=False)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                parts = [self.model(torch.from_numpy(np.ascontiguousarray(x[i : i + batch_size])))
                         for i in range(0, len(x), batch_size)]
        finally:
            self.model.train(was_training)
        return torch.cat(parts).numpy() if parts else np.empty((0,))

    def plot(self, path: str | Path = "scores.png") -> Path:
        """Write accuracy and loss against time to a PNG and return its path."""
        from dask_train.report import plot_history

        return plot_history(self.history, path)


def scorer_record(cpu: Mapping[str, Any] | None, *, wall_s: float) -> dict[str, Any]:
    """``FitResult.scorer`` from what the scorer returned of its CPU (None: no scorer)."""
    if not cpu:
        return {}
    spent = float(cpu.get("cpu_s", 0.0))
    return {**cpu, "cpu_s": round(spent, 4),
            "share": round(spent / wall_s, 4) if wall_s > 0 else math.nan}
