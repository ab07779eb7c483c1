"""Stop conditions: pure policies asked, on each score record and on ticks, whether to stop.

Stopping is the returned ``True``, never an exception; state goes into checkpoints via ``state_dict``.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from dask_train.errors import InvalidInput

Record = Mapping[str, Any]  # a score record: time_s, step, epoch, samples, accuracy, loss, ...
_SCALE = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0}


class StopCondition(ABC):
    """A policy deciding from score records and ticks whether the training job should stop.

    Examples
    --------
    >>> check_stop([StopAtStep(10), StopAfter(60)], None, elapsed_s=61.0, step=5)
    StopAfter(60s)
    """

    @abstractmethod
    def should_stop(self, record: Record | None, *, elapsed_s: float, step: int) -> bool:
        """Return True to stop; ``record`` is a new score record or None for a tick."""

    @abstractmethod
    def describe(self) -> str:
        """Return a short description, used in ``result.stopped_by``."""

    def __repr__(self) -> str:
        return self.describe()

    @property
    def max_step(self) -> int | None:
        """The step at which this condition stops exactly, if it is a step limit; else None."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Return the JSON-able state needed to resume this condition (empty when stateless)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state returned by :meth:`state_dict` (a no-op when stateless)."""

    def reset(self) -> None:
        """Forget any state gathered from records (a no-op when stateless)."""


def _is_number(value: object, minimum: float = -math.inf, *, integer: bool = False) -> bool:
    """True for a finite real (an integer if asked) >= minimum; numpy scalars count, bools do not."""
    # bool is an int subclass, but True as a count or a threshold is a mistake, not a number.
    kind = numbers.Integral if integer else numbers.Real
    if not isinstance(value, kind) or isinstance(value, bool):
        return False
    return math.isfinite(value) and float(value) >= minimum


def _fmt(value: float) -> str:
    """Format a number compactly: ``300.0 -> '300'``, ``0.97 -> '0.97'``."""
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


def _infer_mode(metric: str) -> str:
    """Lower is better for losses and errors, higher for everything else."""
    return "min" if "loss" in metric.lower() or "error" in metric.lower() else "max"


def _check_metric_and_mode(metric: object, mode: object, problems: list[str]) -> str:
    """Append the problems with ``metric`` and ``mode``; return the resolved mode."""
    if not isinstance(metric, str) or not metric:
        problems.append(f"metric={metric!r} is invalid: use a non-empty string, e.g. 'loss'.")
    if mode in ("max", "min"):
        return str(mode)
    if mode is not None:
        problems.append(f"mode={mode!r} is invalid: use 'max', 'min' or None to infer it.")
    return _infer_mode(metric) if isinstance(metric, str) else "max"


def _metric_value(record: Record, metric: str) -> float | None:
    """The metric as a float (NaN kept), or None when it is absent or not a real number."""
    value = record.get(metric)
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None


class StopAtScore(StopCondition):
    """Stop when a score record's metric reaches a threshold (never on ticks, absent or NaN scores).

    Parameters
    ----------
    metric : str
        Key of the score record, e.g. ``"accuracy"`` or ``"loss"``.
    threshold : float
        A finite number the metric must reach.
    mode : {"max", "min"} or None
        ``"max"`` stops at ``metric >= threshold``, ``"min"`` at ``metric <= threshold``. None infers
        ``"min"`` when the metric name contains "loss" or "error", else ``"max"``.

    Examples
    --------
    >>> stop = StopAtScore("accuracy", 0.97)
    >>> stop.should_stop({"accuracy": 0.98}, elapsed_s=5.0, step=100), stop
    (True, StopAtScore(accuracy>=0.97))
    """

    def __init__(self, metric: str, threshold: float, mode: str | None = None) -> None:
        problems: list[str] = []
        self.mode = _check_metric_and_mode(metric, mode, problems)
        if not _is_number(threshold):
            problems.append(f"threshold={threshold!r} is invalid: use a finite number.")
        if problems:
            raise InvalidInput(problems)
        self.metric, self.threshold = metric, float(threshold)

    def should_stop(self, record: Record | None, *, elapsed_s: float, step: int) -> bool:
        value = None if record is None else _metric_value(record, self.metric)
        if value is None or math.isnan(value):
            return False
        return value >= self.threshold if self.mode == "max" else value <= self.threshold

    def describe(self) -> str:
        op = ">=" if self.mode == "max" else "<="
        return f"StopAtScore({self.metric}{op}{_fmt(self.threshold)})"


class StopAtStep(StopCondition):
    """Stop when the global step reaches ``n``, on records and on ticks.

    Parameters
    ----------
    n : int
        The step to stop at, an integer >= 1. Exposed as :attr:`max_step` so that parameter
        servers can refuse updates past it and the step is met exactly.

    Examples
    --------
    >>> StopAtStep(100).should_stop(None, elapsed_s=1.0, step=100), StopAtStep(100).max_step
    (True, 100)
    """

    def __init__(self, n: int) -> None:
        if not _is_number(n, 1, integer=True):
            raise InvalidInput([f"n={n!r} is invalid: use an integer >= 1."])
        self.n: int = int(n)

    def should_stop(self, record: Record | None, *, elapsed_s: float, step: int) -> bool:
        return step >= self.n

    def describe(self) -> str:
        return f"StopAtStep({self.n})"

    @property
    def max_step(self) -> int | None:
        return self.n


class StopAfter(StopCondition):
    """Stop when the job has run for a total wall-clock time, on records and on ticks.

    Parameters
    ----------
    seconds, minutes, hours : float or None
        Added together; each given one a finite number >= 0, and the total must be > 0.

    Examples
    --------
    >>> stop = StopAfter(minutes=5)
    >>> stop.should_stop(None, elapsed_s=300.0, step=0), stop
    (True, StopAfter(300s))
    """

    def __init__(
        self,
        seconds: float | None = None,
        *,
        minutes: float | None = None,
        hours: float | None = None,
    ) -> None:
        given = {k: v for k, v in zip(_SCALE, (seconds, minutes, hours)) if v is not None}
        bad = [k for k, v in given.items() if not _is_number(v, 0.0)]
        problems = [f"{k}={given[k]!r} is invalid: use a finite number >= 0." for k in bad]
        total = 0.0 if bad else sum(float(v) * _SCALE[k] for k, v in given.items())
        if not bad and total <= 0:
            args = ", ".join(f"{k}={v!r}" for k, v in given.items())
            fix = "give seconds, minutes or hours summing to > 0."
            problems.append(f"StopAfter({args}) is invalid: {fix}")
        if problems:
            raise InvalidInput(problems)
        self.seconds = total

    def should_stop(self, record: Record | None, *, elapsed_s: float, step: int) -> bool:
        return elapsed_s >= self.seconds

    def describe(self) -> str:
        return f"StopAfter({_fmt(self.seconds)}s)"


class EarlyStopping(StopCondition):
    """Stop when a metric has not improved for ``patience`` score records in a row.

    A NaN score counts as no improvement; a record without the metric is ignored. Once fired the
    condition stays fired (ticks included) until :meth:`reset` or :meth:`load_state_dict`.

    Parameters
    ----------
    metric : str
        Key of the score record to watch.
    patience : int
        Number of records without improvement that stops the job, an integer >= 1.
    min_delta : float
        An improvement must beat the best so far by more than this, a finite number >= 0.
    mode : {"max", "min"} or None
        Whether higher or lower is better; None infers it from the name as :class:`StopAtScore` does.

    Examples
    --------
    >>> stop = EarlyStopping("loss", patience=2)
    >>> [stop.should_stop({"loss": v}, elapsed_s=0.0, step=0) for v in (1.0, 0.5, 0.6, 0.5)]
    [False, False, False, True]
    """

    def __init__(
        self, metric: str = "loss", patience: int = 5, min_delta: float = 0, mode: str | None = None
    ) -> None:
        problems: list[str] = []
        self.mode = _check_metric_and_mode(metric, mode, problems)
        if not _is_number(patience, 1, integer=True):
            problems.append(f"patience={patience!r} is invalid: use an integer >= 1.")
        if not _is_number(min_delta, 0.0):
            problems.append(f"min_delta={min_delta!r} is invalid: use a finite number >= 0.")
        if problems:
            raise InvalidInput(problems)
        self.metric, self.patience, self.min_delta = metric, int(patience), float(min_delta)
        self.best: float | None = None
        self.wait = 0

    def _improves(self, value: float) -> bool:
        if self.best is None or math.isnan(value):
            return not math.isnan(value)
        gain = value - self.best if self.mode == "max" else self.best - value
        return gain > self.min_delta

    def should_stop(self, record: Record | None, *, elapsed_s: float, step: int) -> bool:
        """Count the record as an improvement or not; return True once ``patience`` is reached."""
        value = None if record is None else _metric_value(record, self.metric)
        if value is not None and self._improves(value):
            self.best, self.wait = value, 0
        elif value is not None:
            self.wait += 1
        return self.wait >= self.patience

    def describe(self) -> str:
        # The mode is shown only where it differs from the one the metric name implies.
        mode = f", mode={self.mode}" if self.mode != _infer_mode(self.metric) else ""
        delta = _fmt(self.min_delta)
        return f"EarlyStopping({self.metric}, patience={self.patience}, min_delta={delta}{mode})"

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"best": float or None, "wait": int}``."""
        return {"best": self.best, "wait": self.wait}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the best score and the count of records without improvement."""
        best, wait = state.get("best"), state.get("wait")
        if (best is not None and not _is_number(best)) or not _is_number(wait, 0, integer=True):
            fix = "use state_dict()'s output: 'best' a finite number or None, 'wait' an int >= 0."
            raise InvalidInput([f"state={dict(state)!r} is invalid: {fix}"])
        self.best = None if best is None else float(best)
        self.wait = int(wait or 0)

    def reset(self) -> None:
        self.best, self.wait = None, 0


def check_stop(
    conditions: Sequence[StopCondition], record: Record | None, *, elapsed_s: float, step: int
) -> StopCondition | None:
    """Ask every condition and return the first (in order) that fires, or None.

    Every condition is asked even after one fires: stateful ones such as :class:`EarlyStopping`
    must see each record for the state saved in the final checkpoint to be right.

    Examples
    --------
    >>> conditions = [StopAtScore("accuracy", 0.9), StopAtStep(50)]
    >>> check_stop(conditions, {"accuracy": 0.5}, elapsed_s=1.0, step=50)
    StopAtStep(50)
    """
    fired = [c for c in conditions if c.should_stop(record, elapsed_s=elapsed_s, step=step)]
    return fired[0] if fired else None


__all__ = ["EarlyStopping", "StopAfter", "StopAtScore", "StopAtStep", "StopCondition", "check_stop"]
