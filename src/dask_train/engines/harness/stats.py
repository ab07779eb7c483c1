"""What each role did in the last second: ``{"kind": "stats", ...}`` events on the job's topic.

Trainers and parameter servers keep running totals (samples, steps, seconds spent waiting) and
publish, at most once per :data:`STATS_EVERY_S`, each total with the amount it grew by since the
previous report. The controller hands them to ``Callback.on_stats`` (TensorBoard); the
scheduler's Training page and its Prometheus metrics read the same events. Once a second per role
is a few hundred bytes a second, nothing beside the block and score events the job already sends,
and a report costs a clock read per batch.

A report (``role`` is ``"trainer"`` or ``"ps"``; ``worker`` is added by the scheduler)::

    {"kind": "stats", "role": "trainer", "index": 0, "step": 1234, "wall": 1.7e9,
     "interval_s": 1.0, "samples": 51200, "samples_total": 409600, "steps": 400,
     "steps_total": 3200, "feed_wait_s": 0.01, "feed_wait_s_total": 0.3,
     "server_wait_s": 0.05, "server_wait_s_total": 0.4, "memory_limit": 2**30,
     "held_bytes": 26400000, "held_bytes_max": 39600000, "read_s_by_epoch": [0.6, 0.2], ...}

A trainer's report carries its memory too (not totals: each as it is now): its worker's memory
limit, the bytes of blocks it holds now and at most, and its read time per epoch
(:meth:`dask_train.data.FeedReader.stats`).

``step`` is the job's step as this role last saw it (the servers' update count), so every
report can be placed on the same axis as the scores.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

#: Seconds between two reports of one role.
STATS_EVERY_S = 1.0


def topic_of(job: str) -> str:
    """The event topic of a job's generation key (the role engines' topic)."""
    return f"dask-train-{job}"


class StatsReporter:
    """Publishes one role's running totals at most every ``every_s`` seconds.

    Parameters
    ----------
    worker : distributed.Worker
        Publishes with ``worker.log_event`` (thread-safe: trainers run in seceded threads).
    topic : str
    role : str
        ``"trainer"`` or ``"ps"``.
    index : int
        The trainer's or the shard's index.
    every_s : float
    start : mapping, optional
        Totals already reached before this role started (a resumed job's step count): the
        first report counts only what grew after them.
    extra : callable, optional
        Figures that are not totals, read at each report and sent as they are (a trainer's
        memory: its worker's limit, the bytes of blocks it holds, its read time per epoch).

    Examples
    --------
    >>> class W:
    ...     def log_event(self, topic, msg): print(msg["samples"], msg["samples_total"])
    >>> stats = StatsReporter(W(), topic="t", role="trainer", index=0, every_s=0.0)
    >>> stats.report(step=1, samples=128)
    128 128
    >>> stats.report(step=2, samples=384)
    256 384
    """

    def __init__(self, worker: Any, *, topic: str, role: str, index: int,
                 every_s: float = STATS_EVERY_S, start: dict[str, float] | None = None,
                 extra: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.worker, self.topic, self.role, self.index = worker, topic, role, index
        self.extra = extra
        self.every_s = every_s
        self.last_time = time.perf_counter()
        self.last: dict[str, float] = dict(start or {})

    def report(self, *, step: int, force: bool = False, **totals: float) -> None:
        """Publish ``totals`` and their growth since the last report, if one is due (or ``force``)."""
        now = time.perf_counter()
        interval = now - self.last_time
        if interval < self.every_s and not force:
            return
        msg: dict[str, Any] = {"kind": "stats", "role": self.role, "index": self.index,
                               "step": int(step), "wall": time.time(), "interval_s": interval}
        for name, total in totals.items():
            msg[name] = total - self.last.get(name, 0)
            msg[f"{name}_total"] = total
        if self.extra is not None:
            msg.update(self.extra())
        self.last, self.last_time = dict(totals), now
        self.worker.log_event(self.topic, msg)

