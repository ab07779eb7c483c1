"""``dt.search``: hyper-parameter search where each trial is a job on its own reserved workers.

The client runs one loop (:class:`_Search`): ask optuna for a trial, reserve the workers it needs
all at once (:class:`~._gangs.Reservations`), run it in a trial thread, collect it when it ends
and tell optuna. Several trials run at once, each on its own gang; a trial's live scores feed
optuna's pruner, and a pruned trial stops through its job's stop path, freeing its workers.
A trial that raises or loses its worker is recorded as failed and the search goes on; one that
lost a worker is run again on a fresh gang up to ``retries`` times first (a trial whose own code
raised is not: it would raise again). Ctrl-C stops every running trial and returns what finished.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distributed import Client

from dask_train.data._cluster import declared_resources
from dask_train.errors import InvalidInput
from dask_train.policy.stop import StopCondition, check_stop
from dask_train.runtime import default_client
from dask_train.runtime._calls import live_workers
from dask_train.tuning._checks import (
    check_arguments,
    make_pruner,
    make_runner,
    stop_problems,
)
from dask_train.tuning._data import SearchData, prepare_data
from dask_train.tuning._gangs import Reservations
from dask_train.tuning._records import TrialRecord
from dask_train.tuning._result import SearchResult
from dask_train.tuning._space import Space
from dask_train.tuning._trial import STEPS, TrialContext, TrialRunner, lost_worker

logger = logging.getLogger(__name__)


def search(model: Any, space: Any, X: Any, y: Any, *, validation: Any, metric: Any = None,
           mode: str | None = None, n_trials: int = 20, max_concurrent: int | None = None,
           workers_per_trial: int | None = None, sampler: Any = None, pruner: Any = "asha",
           stop: Sequence[StopCondition] | StopCondition | None = None, timeout: float = 60.0,
           seed: int = 0, progress: bool = True, retries: int = 0,
           client: Client | None = None) -> SearchResult:
    """Search hyper-parameters on the cluster: each trial a job on its own reserved workers.

    Parameters
    ----------
    model : dt.Trainer or estimator
        A :class:`~dask_train.Trainer` (its ``module`` may be a factory of torch modules called
        with the space's other names), an ``xgboost.dask`` estimator, or any estimator.
    space : dict
        Name -> :func:`loguniform`, :func:`uniform`, :func:`intuniform`, a list of choices, or a
        fixed value: Trainer (or module factory) parameters, or an estimator's ``get_params()``.
    X, y : dask or in-memory arrays, dask DataFrame/Series
        Training data, persisted on the cluster once for all trials.
    validation : (X_val, y_val)
        Held-out data every trial is scored on (held in memory).
    metric : str or callable, optional
        What to optimise. Trainer trials: a score of the job (``"accuracy"`` for classification,
        else ``"loss"`` by default). Estimators: a scikit-learn scorer name or ``fn(y_true,
        y_pred)`` (default ``"accuracy"`` for classifiers, ``"r2"`` else). XGBoost:
        ``"accuracy"``, ``"loss"`` or an XGBoost ``eval_metric`` name.
    mode : {"max", "min"}, optional
        Inferred from the metric when left out ("loss", "error", "rmse"... are minimised).
    n_trials : int
        Trials to run (fewer when a stop condition or Ctrl-C ends the search first).
    max_concurrent : int, optional
        Trials at once; default: as many as the cluster's workers hold (workers // per trial).
    workers_per_trial : int, optional
        Workers each trial reserves; default the Trainer's ``workers``, 2 for XGBoost, else 1.
    sampler : optuna.samplers.BaseSampler, optional
        Default ``optuna.samplers.TPESampler(seed=seed)``.
    pruner : {"asha", None} or optuna.pruners.BasePruner
        ``"asha"``: optuna's SuccessiveHalvingPruner over the trials' live scores (Trainer and
        XGBoost trials; estimators score once, at the end), rungs at 10%, 30% and 90% of a
        trial's planned samples or boosting rounds, keeping the best third at each.
    stop : sequence of StopCondition
        Ends the search (``dt.StopAfter``, ``dt.StopAtScore``); running trials stop, kept complete.
    timeout : float
        Seconds any wait may take: for a gang of free workers, trials stopping after Ctrl-C,
        XGBoost's collectives when a peer is lost.
    seed : int
    progress : bool
        A progress bar over the trials with the best score.
    retries : int
        Times a trial that lost a worker (killed, out of memory, cut off) runs again from its
        start on free workers (default 0: it fails at once); one whose own code raised never
        does. ``trials["attempts"]`` counts each trial's runs.
    client : distributed.Client, optional
        Default: the Trainer's, the current one, or :func:`dask_train.connect`.

    Returns
    -------
    SearchResult
        ``best_params``, ``best_score``, ``best_model``, ``trials`` (a DataFrame), ``plot()``.

    Examples
    --------
    >>> search = dt.search(dt.Trainer(net_fn, workers=2, epochs=3),             # doctest: +SKIP
    ...                    space={"lr": dt.loguniform(1e-4, 1e-1), "hidden": [64, 256]},
    ...                    X=X, y=y, validation=(Xv, yv), n_trials=16, max_concurrent=2)
    >>> search.best_params, search.best_score                                      # doctest: +SKIP
    """
    stops, parsed, optuna_pruner = _checked_arguments(
        space, stop=stop, pruner=pruner, n_trials=n_trials, max_concurrent=max_concurrent, mode=mode,
        workers_per_trial=workers_per_trial, timeout=timeout, validation=validation, sampler=sampler,
        retries=retries)
    client = client or getattr(model, "client", None) or default_client()
    checks = SearchData(*_lazy_arrays(X, y), validation=_numpy_pair(validation))
    metric, mode, runner = make_runner(model, parsed, data=checks, metric=metric, mode=mode, client=client,
                                       workers_per_trial=workers_per_trial, timeout=timeout)
    concurrent = _trials_at_once(runner, parsed, stops, metric=metric, client=client,
                                 max_concurrent=max_concurrent)
    loop = _Search(runner, parsed, _study(mode, sampler=sampler, seed=seed, pruner=optuna_pruner),
                   client=client, metric=metric, mode=mode, n_trials=n_trials, retries=retries,
                   max_concurrent=concurrent, stop=stops, timeout=timeout, progress=progress)
    return loop.run(lambda: prepare_data(X, y, validation, client=client))


def _checked_arguments(space: Any, *, stop: Sequence[StopCondition] | StopCondition | None,
                       pruner: Any, **arguments: Any) -> tuple[list[StopCondition], Space, Any]:
    """``(stop conditions, parsed space, optuna pruner)``; every problem with the arguments that
    needs no cluster (``arguments``: those :func:`check_arguments` takes) raised at once."""
    stops = [stop] if isinstance(stop, StopCondition) else list(stop or [])
    problems = check_arguments(stop=stops, **arguments)
    optuna_pruner = make_pruner(pruner, problems)
    try:
        parsed = Space.parse(space)
    except InvalidInput as exc:
        problems += exc.problems
    if problems:
        raise InvalidInput(problems)
    return stops, parsed, optuna_pruner


def _trials_at_once(runner: TrialRunner, space: Space, stops: list[StopCondition], *,
                    metric: str, client: Client, max_concurrent: int | None) -> int:
    """How many trials run at once (``max_concurrent``, else as many as the cluster's workers
    hold); the problems of the trials on this cluster raised at once."""
    problems = runner.problems() + stop_problems(stops, metric)
    need = runner.workers_needed(space.first())
    placement = runner.placement(space.first())
    alive = len(placement.usable({a: 1 for a in live_workers(client)}, declared_resources(client)))
    if need > alive and placement:
        problems.append(placement.too_few(need=need, what="each trial's gang",
                                          declared=declared_resources(client)))
    elif need > alive:
        problems.append(f"each trial needs {need} workers and the cluster has {alive}: lower "
                        "workers_per_trial (or the Trainer's workers=) or add workers.")
    if problems:
        raise InvalidInput(problems)
    return max_concurrent or max(1, alive // need)


def _study(mode: str, *, sampler: Any, seed: int, pruner: Any) -> Any:
    """The optuna study that samples the trials' parameters (TPE seeded by ``seed`` by default)."""
    import optuna  # here: optuna loads only when a search runs

    return optuna.create_study(direction="maximize" if mode == "max" else "minimize",
                               sampler=sampler or optuna.samplers.TPESampler(seed=seed),
                               pruner=pruner)


def _lazy_arrays(X: Any, y: Any) -> tuple[Any, Any]:
    from dask_train.data._blocks import as_dask_array

    return as_dask_array(X), as_dask_array(y, name="y")


def _numpy_pair(validation: Any) -> tuple[Any, Any]:
    from dask_train.data._inputs import to_numpy

    # Several inputs or targets (a dict or tuple of arrays) as one array of records, as in fit.
    return to_numpy(validation[0], name="X_val"), to_numpy(validation[1], name="y_val")


@dataclass
class _Pending:
    """A trial asked of optuna (or one to run again) that waits for a free gang."""

    trial: Any  # optuna.Trial
    params: dict[str, Any]
    need: int
    record: TrialRecord | None = None  # a retried trial's record, kept across its runs
    last_step: int = -1  # the last step optuna saw from it (a retry reports only later ones)


@dataclass
class _Running:
    ctx: TrialContext
    trial: Any  # optuna.Trial
    record: TrialRecord
    thread: threading.Thread
    outcome: Any = None
    error: BaseException | None = None
    last_step: int = -1
    lost: str = ""  # why, when the trial failed because a worker it ran on was lost


class _Search:
    """The client's loop: ask, reserve, run, collect, tell (see the module docstring)."""

    def __init__(self, runner: TrialRunner, space: Space, study: Any, *, client: Client,
                 metric: Any, mode: str, n_trials: int, max_concurrent: int,
                 stop: list[StopCondition], timeout: float, progress: bool,
                 retries: int = 0) -> None:
        self.runner, self.space, self.study, self.client = runner, space, study, client
        self.metric, self.mode, self.n_trials = metric, mode, n_trials
        self.max_concurrent, self.stop, self.timeout = max_concurrent, stop, timeout
        self.retries = retries
        self.again: list[_Pending] = []  # trials that lost a worker, to run again first
        self.book = Reservations()
        self.records: list[TrialRecord] = []
        self.running: dict[int, _Running] = {}
        self.finished: queue.Queue[int] = queue.Queue()
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.cache: dict[Any, Any] = {}
        self.stopped_by = ""
        self.interrupted = False
        self.started = time.monotonic()
        self.asked = 0
        self.reports = 0
        self.interrupt_sent: set[int] = set()
        self.bar = _progress_bar(n_trials, progress)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # -- the loop -----------------------------------------------------------------------------------
    def run(self, prepare: Any) -> SearchResult:
        data = None
        try:
            data = prepare()
            self.runner.data = data  # type: ignore[attr-defined]
            self.runner.prepare()
            self._loop()
        except KeyboardInterrupt:
            self._interrupt()
        finally:
            self.runner.close()
            self.cache.clear()
            if data is not None:
                data.release()
            # The trials' contexts refer back to this loop: without this, the persisted data
            # would stay on the cluster until the garbage collector finds the cycle.
            self.runner.data = None  # type: ignore[attr-defined]
            self.running.clear()
            if self.bar is not None:
                self.bar.close()
        return SearchResult(self.records, metric=str(getattr(self.metric, "__name__",
                                                                   self.metric)),
                            mode=self.mode, stopped_by=self.stopped_by, wall_s=self.elapsed(),
                            study=self.study, param_names=self.space.names)

    def _loop(self) -> None:
        pending: _Pending | None = None
        waiting_since = time.monotonic()
        while True:
            self._collect()
            self._check_stop(None)
            self._relay_stop()
            if self.stopped_by and not self.running:
                break
            if pending is None and self.again and not self.stopped_by:
                # A retry goes before any new trial; its wait for a gang starts now (its
                # worker's replacement may still be starting).
                pending, waiting_since = self.again.pop(0), time.monotonic()
            if self.asked >= self.n_trials and pending is None:
                if not self.running:
                    self.stopped_by = self.stopped_by or f"n_trials={self.n_trials}"
                    break
            elif not self.stopped_by and len(self.running) < self.max_concurrent:
                if pending is None:
                    trial = self.study.ask(self.space.distributions())
                    self.asked += 1
                    params = self.space.values(trial.params)
                    pending = _Pending(trial, params, self.runner.workers_needed(params))
                if self._start(pending):
                    pending, waiting_since = None, time.monotonic()
                    continue
                if not self.running and time.monotonic() - waiting_since > self.timeout:
                    self._give_up(pending)
                    break
            self._wait(0.2)
        for never in [pending, *self.again]:  # never (re)started: optuna must not keep it running
            if never is not None:
                self._never_ran(never)

    def _start(self, pending: _Pending) -> bool:
        trial, params = pending.trial, pending.params
        # Only workers that declare the trial's resources (every worker without any).
        alive = self.runner.placement(pending.params).usable(
            {a: 1 for a in live_workers(self.client)}, declared_resources(self.client))
        gang = self.book.take(alive, need=pending.need, trial=trial.number)
        if gang is None:
            return False
        data = getattr(self.runner, "data", None)
        if data is not None:  # a lost worker's share of in-memory data is sent again first
            data.refresh()
        record = pending.record
        if record is None:
            record = TrialRecord(trial.number, params, "running", math.nan, self.elapsed(),
                                 math.nan, gang)
            self.records.append(record)
        else:  # a retry: the same record and optuna trial, a fresh gang
            record.state, record.workers, record.attempts = "running", gang, record.attempts + 1
        running = _Running(ctx=None, trial=trial, record=record,  # type: ignore[arg-type]
                           thread=threading.Thread(daemon=True), last_step=pending.last_step)
        running.ctx = TrialContext(trial.number, params, gang,
                                   report=functools.partial(self._report, running),
                                   stopping=self.stopping, cache=self.cache)
        running.thread = threading.Thread(target=self._run_trial, args=(running,), daemon=True,
                                          name=f"dt-trial-{trial.number}")
        self.running[trial.number] = running
        running.thread.start()
        logger.info("trial %d started on %s: %s%s", trial.number, gang, params,
                    f" (attempt {record.attempts})" if record.attempts > 1 else "")
        return True

    def _run_trial(self, running: _Running) -> None:
        try:
            # The search's client is the thread's current one: Dask calls inside the trial that
            # use the default client (distributed.wait) must not pick another client's loop.
            with self.client.as_current():
                running.outcome = self.runner.run(running.ctx)
        except BaseException as exc:  # recorded as the trial's failure; the search goes on
            running.error = exc
        finally:
            self.finished.put(running.ctx.number)

    def _wait(self, seconds: float) -> None:
        try:
            number = self.finished.get(timeout=seconds)
            self.finished.put(number)  # _collect takes it
        except queue.Empty:
            pass

    def _give_up(self, pending: _Pending) -> None:
        alive = len(live_workers(self.client))
        self.stopped_by = (f"no {pending.need} free workers for {self.timeout:g} s (the cluster "
                           f"has {alive})")
        logger.warning("search stopped: %s", self.stopped_by)

    def _never_ran(self, pending: _Pending) -> None:
        """A trial asked (or to be retried) that the search ended before it could run."""
        record = pending.record
        if record is not None:  # a retry that never started: its last run's loss stands
            record.state, record.error = "failed", record.retried_after.pop()
        self._tell(pending.trial, "failed", math.nan)

    # -- scores, stop conditions ----------------------------------------------------------------------
    def _report(self, running: _Running, value: float, step: int) -> bool:
        """A trial's live score (from its job's event loop or callback thread)."""
        now = self.elapsed()
        with self.lock:
            running.record.points.append((now, value))
            self.reports += 1
            self._check_stop({str(self.metric): value, "time_s": now, "step": self.reports})
        if step > running.last_step and not running.ctx.pruned:
            running.last_step = step
            running.trial.report(value, step)
            # A trial whose planned training is done has nothing left for a pruner to save: its
            # last score is a complete trial's, whatever the pruner would say of it.
            if step < STEPS and running.trial.should_prune():
                running.ctx.pruned = True
                logger.info("trial %d pruned at step %d (%s=%.4g)", running.ctx.number, step,
                            self.metric, value)
        return running.ctx.pruned or self.stopping.is_set()

    def _check_stop(self, record: dict[str, Any] | None) -> None:
        if self.stopped_by or not self.stop:
            return
        fired = check_stop(self.stop, record, elapsed_s=self.elapsed(), step=self.reports)
        if fired is not None:
            self.stopped_by = fired.describe()
            self.stopping.set()
            logger.info("search stopping: %s", self.stopped_by)

    def _relay_stop(self) -> None:
        """Once the search stops, ask every running trial to end (from the search's own thread:
        ``_check_stop`` also runs on the client's event loop, where a blocking call to the
        workers would wait on that very loop)."""
        if not self.stopping.is_set():
            return
        for number, running in list(self.running.items()):
            if number not in self.interrupt_sent:
                self.interrupt_sent.add(number)
                self.runner.interrupt(running.ctx)

    # -- ending trials ---------------------------------------------------------------------------------
    def _collect(self) -> None:
        while True:
            try:
                number = self.finished.get_nowait()
            except queue.Empty:
                return
            running = self.running.pop(number, None)
            if running is None:
                continue
            self.book.give_back(number)
            self._finish(running)

    def _finish(self, running: _Running) -> None:
        record, outcome, error = running.record, running.outcome, running.error
        record.end_s = self.elapsed()
        if error is not None and self._retried(running, error):
            return
        if error is not None:
            interrupted = type(error).__name__ == "Interrupted"
            record.state = "interrupted" if interrupted else "failed"
            record.error = running.lost or f"{type(error).__name__}: {error}"
        else:
            record.score, record.model, record.result = outcome.score, outcome.model, outcome.result
            record.stopped_by = outcome.stopped_by
            if not record.points and not math.isnan(outcome.score):
                record.points.append((record.end_s, outcome.score))
            # Pruned only when the pruner's decision ended the trial (not when the trial reached
            # its own stop condition or its planned training at the score it was decided).
            record.state = "pruned" if outcome.pruned else \
                "interrupted" if self.interrupted else "complete"
            if record.state == "complete" and math.isnan(record.score):
                record.state, record.error = "failed", f"no {self.metric} score was recorded"
            if record.state == "complete":  # the final score counts for the search's stop too
                with self.lock:
                    self._check_stop({str(self.metric): record.score, "time_s": record.end_s,
                                      "step": self.reports})
        self._tell(running.trial, record.state, record.score)
        log = logger.warning if record.state == "failed" else logger.info
        log("trial %d %s: %s=%.4g in %.1f s %s%s", record.number, record.state, self.metric,
            record.score, record.end_s - record.start_s, record.params,
            f" ({record.error})" if record.error else "")
        if self.bar is not None:
            self.bar.update(1)
            best = SearchResult(self.records, str(self.metric), self.mode, "", 0.0).best_score
            self.bar.set_postfix_str(f"best {self.metric}={best:.4g}")

    def _retried(self, running: _Running, error: BaseException) -> bool:
        """Whether a failed trial lost a worker; if so, and the search allows another run, the
        trial waits to run again on a fresh gang. Its error is recorded either way."""
        if type(error).__name__ == "Interrupted" or self.stopping.is_set():
            return False
        record = running.record
        running.lost = lost_worker(error, record.workers, number=record.number,
                                   alive=lambda: live_workers(self.client))
        if not running.lost or record.attempts > self.retries:
            return False
        record.retried_after.append(running.lost)
        logger.warning("trial %d will run again (attempt %d of %d): %s", record.number,
                       record.attempts + 1, self.retries + 1, running.lost)
        self.again.append(_Pending(running.trial, record.params, self.runner.workers_needed(
            record.params), record=record, last_step=running.last_step))
        return True

    def _tell(self, trial: Any, state: str, score: float) -> None:
        from optuna.trial import TrialState

        if state == "complete":
            self.study.tell(trial, score, skip_if_finished=True)
        else:
            self.study.tell(trial, state=TrialState.PRUNED if state == "pruned" else
                            TrialState.FAIL, skip_if_finished=True)

    def _interrupt(self) -> None:
        """Ctrl-C: stop every running trial, wait for them (bounded), keep what finished."""
        self.interrupted = True
        self.stopped_by = "KeyboardInterrupt"
        self.stopping.set()
        logger.warning("search interrupted: stopping %d running trial(s)", len(self.running))
        for pending in self.again:  # lost a worker and waited to run again: failed
            self._never_ran(pending)
        self.again.clear()
        self._relay_stop()
        deadline = time.monotonic() + self.timeout + 10.0
        while self.running and time.monotonic() < deadline:
            self._wait(0.2)
            self._collect()
        for number, running in list(self.running.items()):  # still running: given up on
            running.record.state, running.record.end_s = "interrupted", self.elapsed()
            running.record.error = f"did not stop within {self.timeout + 10.0:g} s"
            self._tell(running.trial, "interrupted", math.nan)
            self.running.pop(number)


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="trials", unit="trial", file=sys.stderr, leave=True)
