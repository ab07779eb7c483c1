"""Callbacks: a base class of no-op ``on_*`` hooks the controller calls during ``fit``
(off the client's event loop: see :class:`Callback` for where each hook runs).

A hook that returns True asks the job to stop; stopping is that returned decision, never an
exception. :func:`run_callbacks` calls one hook on every callback and reports whether any asked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dask_train.errors import InvalidInput

HOOKS = ("on_fit_start", "on_score", "on_stats", "on_epoch_end", "on_fit_end", "on_fit_error")


class Callback:
    """Base class for callbacks; every hook is a no-op, override the ones you need.

    Where the hooks run, and what they may do: ``on_fit_start`` and ``on_fit_end`` (or
    ``on_fit_error``, for a job that raised) are called in the thread that called ``fit`` (or
    ``dt.run``), before the job starts and after it ended.
    ``on_score``, ``on_stats`` and ``on_epoch_end`` are called in the client process, one at a
    time and in the order of the job's events, on a thread of their own: not on the client's
    event loop, which carries the job's messages. So a hook may block (write to a tracking
    server or a file system, sleep) while the job goes on training, scoring and deciding its
    stop conditions, and it may use the client as in any script (``client.run(...)``,
    ``client.submit(...).result()``). A hook that returns True asks the job to stop; the
    controller acts on it at its next pass (within about 0.2 s of the hook's return), so a slow
    hook delays its own stop, not the job's others. A hook's exception ends the job. Hooks queue
    up while a slow one runs, and the job's end waits for them (up to the job's ``timeout``)
    before ``on_fit_end``. The job's own parts never wait for a hook: keep a hook cheaper than
    the rate of its events (``on_stats`` comes about once a second per role) or it falls behind.

    Examples
    --------
    >>> class StopOnBadLoss(Callback):
    ...     def on_score(self, record):
    ...         return record.get("loss", 0.0) > 100.0
    >>> StopOnBadLoss().on_score({"loss": 1e6})
    True
    """

    def on_fit_start(self, info: Mapping[str, Any]) -> None:
        """Called once before training starts with a description of the job: ``roles``,
        ``rows`` (per epoch) and ``params`` (a Trainer's hyper-parameters; ``dt.run``'s
        ``config``, and its settings under ``"run"``)."""

    def on_score(self, record: Mapping[str, Any]) -> bool | None:
        """Called with each new score record; return True to ask the job to stop."""
        return None

    def on_stats(self, stats: Mapping[str, Any]) -> None:
        """Called about once a second per trainer and per parameter server with what it did.

        ``stats["role"]`` is ``"trainer"`` or ``"ps"``, ``stats["index"]`` its index,
        ``stats["step"]`` the job's step as that role saw it, ``stats["interval_s"]`` the
        seconds covered. For each running total (trainers: ``samples``, ``steps``,
        ``feed_wait_s``, ``server_wait_s`` -- time waiting for the servers' replies, or for the
        all-reduce in a sync job; servers: ``updates``, ``samples``) the report holds the growth
        over the interval under the name and the total under ``<name>_total``. Numpy models
        (``dt.ArrayModel``) send none.
        """

    def on_epoch_end(self, epoch: int, record: Mapping[str, Any] | None) -> bool | None:
        """Called when an epoch ends with the latest score record (if any); True asks to stop."""
        return None

    def on_fit_end(self, result: Any) -> None:
        """Called once after training ends with the fit result."""

    def on_fit_error(self, error: BaseException, partial: Mapping[str, Any]) -> None:
        """Called once instead of :meth:`on_fit_end` when the job raised after ``on_fit_start``:
        a role's own error, workers lost beyond ``max_failures``, a timeout, or
        ``KeyboardInterrupt`` (Ctrl-C). The job raises ``error`` once every callback returned
        (an exception of this hook is logged, never raised in its place).

        ``partial`` is what the job had: ``records`` (the score records so far), ``checkpoints``
        (those written, each with its ``directory``; the last is the newest) and ``failures``
        (the lost roles it survived). The hooks queued before the error ran first (for up to
        10 s).
        """


def run_callbacks(callbacks: Sequence[Callback], hook: str, *args: Any) -> bool:
    """Call ``hook`` on every callback and return True if any of them asked to stop.

    Every callback is called even after one asks to stop, so that each sees the same events
    (a :class:`History` must not miss the final record).

    Parameters
    ----------
    callbacks : sequence of Callback
        The callbacks, called in order.
    hook : str
        One of :data:`HOOKS`.
    *args
        Passed to the hook.

    Examples
    --------
    >>> history = History()
    >>> run_callbacks([history], "on_score", {"step": 10, "loss": 0.5})
    False
    >>> history.records
    [{'step': 10, 'loss': 0.5}]
    """
    if hook not in HOOKS:
        raise InvalidInput([f"hook={hook!r} is invalid: use one of {', '.join(HOOKS)}."])
    answers = [getattr(callback, hook)(*args) for callback in callbacks]
    return any(bool(answer) for answer in answers)


class History(Callback):
    """Keep every score record seen during the latest fit.

    Attributes
    ----------
    records : list of dict
        Copies of the score records, in order; cleared at the start of each fit.
    epochs : list of int
        The epochs reported as ended.
    info : dict
        The job description given to ``on_fit_start``.
    result : object
        The fit result given to ``on_fit_end`` (None until then).

    Examples
    --------
    >>> history = History()
    >>> history.on_fit_start({"strategy": "async-ps"})
    >>> history.on_score({"step": 1, "loss": 2.0})
    >>> history.on_score({"step": 2, "loss": 1.5})
    >>> [r["loss"] for r in history.records]
    [2.0, 1.5]
    """

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.epochs: list[int] = []
        self.info: dict[str, Any] = {}
        self.result: Any = None

    def on_fit_start(self, info: Mapping[str, Any]) -> None:
        """Clear what an earlier fit left and keep the job description."""
        self.records = []
        self.epochs = []
        self.info = dict(info)
        self.result = None

    def on_score(self, record: Mapping[str, Any]) -> bool | None:
        """Keep a copy of the record (the caller may reuse its dict); never asks to stop."""
        self.records.append(dict(record))
        return None

    def on_epoch_end(self, epoch: int, record: Mapping[str, Any] | None) -> bool | None:
        """Note the epoch; never asks to stop."""
        self.epochs.append(epoch)
        return None

    def on_fit_end(self, result: Any) -> None:
        """Keep the result."""
        self.result = result


__all__ = ["HOOKS", "Callback", "History", "run_callbacks"]
