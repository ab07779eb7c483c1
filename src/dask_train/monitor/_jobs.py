"""What the Training page and the metrics know of each job, built from the job's events (pure).

The scheduler plugin hands every event of a ``dask-train-*`` topic to :meth:`Jobs.event`:

* on the job's own topic ``dask-train-<job_id>``, the controller's ``start``, ``record`` (a
  history row), ``failure``, ``generation``, ``nonfinite`` and ``end`` events
  (``controller._publish``);
* on a generation's topic ``dask-train-<job_id>-g<n>``, the roles' once-a-second ``stats``
  (``engines.harness.stats``); the other events there (blocks, pauses, scores) are the controller's
  business and are ignored.

Every time axis is seconds since the job started, on the scheduler's clock (``now`` as the event
arrives), so the figures of the controller and of every worker line up whatever their clocks say.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any

PREFIX = "dask-train-"
_TOPIC = re.compile(r"^dask-train-(?P<job>.+?)(?:-g(?P<generation>\d+))?$")
#: Points kept per curve (a score a second for almost three hours); older ones scroll away.
MAX_POINTS = 10_000
#: Lines kept in a job's event log.
MAX_LOG = 500
#: A trainer whose last report is older than this no longer counts in the job's samples/s.
RATE_FRESH_S = 3.0


def parse_topic(topic: str) -> tuple[str, int | None] | None:
    """``(job_id, generation)`` of a dask-train topic (generation None for the controller's).

    Examples
    --------
    >>> parse_topic("dask-train-3f2a9c-g1")
    ('3f2a9c', 1)
    >>> parse_topic("dask-train-3f2a9c")
    ('3f2a9c', None)
    >>> parse_topic("all") is None
    True
    """
    match = _TOPIC.match(topic) if topic.startswith(PREFIX) else None
    if match is None:
        return None
    generation = match.group("generation")
    return match.group("job"), None if generation is None else int(generation)


class Series:
    """Columns that grow together; keeps the last ``maxlen`` rows, counts every row ever added.

    A reader remembers ``total`` and later asks :meth:`since` for what came after, so a page
    streams only new points.

    Examples
    --------
    >>> s = Series("x", "y", maxlen=2)
    >>> for i in range(3):
    ...     s.append(x=i, y=i * i)
    >>> s.columns(), s.total
    ({'x': [1, 2], 'y': [1, 4]}, 3)
    >>> s.since(2)
    {'x': [2], 'y': [4]}
    """

    def __init__(self, *names: str, maxlen: int = MAX_POINTS) -> None:
        self.data: dict[str, deque[Any]] = {n: deque(maxlen=maxlen) for n in names}
        self.total = 0

    def append(self, **row: Any) -> None:
        """Add one row (every column, by name)."""
        for name, column in self.data.items():
            column.append(row[name])
        self.total += 1

    def columns(self) -> dict[str, list[Any]]:
        """Every kept row."""
        return {name: list(column) for name, column in self.data.items()}

    def since(self, seen: int) -> dict[str, list[Any]]:
        """The rows added after the first ``seen`` (those still kept)."""
        kept = len(next(iter(self.data.values()), ()))
        new = min(max(0, self.total - seen), kept)
        # Indexing a deque near its end is cheap; copying it whole twice a second is not.
        return {name: [column[-k] for k in range(new, 0, -1)]
                for name, column in self.data.items()}


def _finite(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number if math.isfinite(number) else math.nan


class JobView:
    """One job as the page shows it: score curves, per-role figures, totals and an event log."""

    def __init__(self, job_id: str, *, now: float) -> None:
        self.job_id, self.started = job_id, now
        self.info: dict[str, Any] = {}
        self.state, self.stopped_by, self.ended = "running", "", 0.0
        self.generation = 0
        self.scores: dict[str, Series] = {}  # metric -> (time_s, step, value)
        self.throughput = Series("time_s", "samples_per_s")  # all trainers, at each report
        # (time_s, samples_per_s, data_wait, server_wait, steps_per_s)
        self.trainers: dict[int, Series] = {}
        self.servers: dict[int, Series] = {}  # (time_s, updates_per_s)
        self.scorer = Series("time_s", "cpu_share")  # cores the scorer took, at each report
        self.log: deque[tuple[float, str, str]] = deque(maxlen=MAX_LOG)
        self.log_total = 0  # lines ever added (the log keeps the last MAX_LOG)
        self.latest: dict[str, Any] = {}  # the last history row
        self.samples_total = 0.0
        self.wait_total: dict[tuple[int, str], float] = {}  # (trainer, "data"|"servers") -> s
        self.trainer_rate: dict[int, tuple[float, float]] = {}  # (samples/s, when reported)
        self.updates_total: dict[int, float] = {}
        self.failures: dict[str, int] = {}  # action -> count
        # trainer -> its worker, the worker's memory limit, bytes of blocks held now and at most,
        # read seconds per epoch: as its last report said (see engines.harness.stats)
        self.memory: dict[int, dict[str, Any]] = {}
        self.memory_seen = 0  # reports taken into ``memory``: the page redraws when it moves
        self.nonfinite = 0
        self.step = 0
        self.workers: set[str] = set()

    def elapsed(self, now: float) -> float:
        """Seconds since the job started."""
        return max(0.0, now - self.started)

    def note(self, now: float, kind: str, text: str) -> None:
        """Add a line to the event log."""
        self.log.append((round(self.elapsed(now), 2), kind, text))
        self.log_total += 1

    # -- the controller's events ------------------------------------------------------------------
    def controller_event(self, msg: Mapping[str, Any], *, now: float) -> None:
        """Take one of the controller's events (see the module docstring)."""
        kind = msg.get("kind")
        if kind == "start":
            self.info = dict(msg)
            roles = msg.get("roles") or {}
            self.workers = {w for addresses in roles.values() for w in addresses}
            self.note(now, "start", f"{msg.get('strategy')} on {_describe_roles(roles)}")
            if msg.get("data"):  # persisted or streamed, with the numbers behind the choice
                self.note(now, "data", str(msg["data"]))
        elif kind == "record":
            self._record(msg, now=now)
        elif kind == "failure":
            action = str(msg.get("action"))
            self.failures[action] = self.failures.get(action, 0) + 1
            self.note(now, "failure", f"{msg.get('role')} on {msg.get('worker')}: "
                                      f"{msg.get('cause')} -> {action}")
        elif kind == "generation":
            self.generation = int(msg.get("generation", self.generation))
            roles = msg.get("roles") or {}
            self.workers |= {w for addresses in roles.values() for w in addresses}
            self.note(now, "restart", f"generation {self.generation} on {_describe_roles(roles)}")
        elif kind == "nonfinite":
            self.nonfinite += 1
            what = msg.get("loss", msg.get("metrics"))
            self.note(now, "nonfinite", f"non-finite {what} at step {msg.get('step')} "
                                        f"on {msg.get('role')}")
        elif kind == "end":
            self.ended = now
            if msg.get("error"):
                self.state, self.stopped_by = "failed", str(msg["error"])
            else:
                self.state, self.stopped_by = "finished", str(msg.get("stopped_by", ""))
            self.note(now, "end", self.stopped_by)

    def _record(self, row: Mapping[str, Any], *, now: float) -> None:
        t = self.elapsed(now)
        self.latest = {k: v for k, v in row.items() if k != "kind"}
        self.step = max(self.step, int(row.get("step", 0)))
        for name, value in row.items():
            if name in _NOT_SCORES or not isinstance(value, (int, float)):
                continue
            if name not in self.scores and not math.isfinite(_finite(value)):
                continue  # a metric this model never produces (NaN placeholders)
            series = self.scores.setdefault(name, Series("time_s", "step", "value"))
            series.append(time_s=t, step=int(row.get("step", 0)), value=_finite(value))

    # -- the roles' figures -----------------------------------------------------------------------
    def stats_event(self, msg: Mapping[str, Any], *, generation: int, now: float) -> None:
        """Take one role's once-a-second report (``engines.harness.stats``)."""
        if generation > self.generation:  # the controller's own event may come later
            self.generation = generation
        index, t = int(msg.get("index", 0)), self.elapsed(now)
        interval = max(_finite(msg.get("interval_s")), 1e-9)
        self.step = max(self.step, int(msg.get("step", 0)))
        if msg.get("worker"):
            self.workers.add(str(msg["worker"]))
        if msg.get("role") == "scorer":  # its CPU, not a trainer's samples
            self.scorer.append(time_s=t, cpu_share=max(0.0, _finite(msg.get("cpu_s"))) / interval)
            return
        if msg.get("role") == "ps":
            updates = max(0.0, _finite(msg.get("updates")))
            self.updates_total[index] = self.updates_total.get(index, 0.0) + updates
            self.servers.setdefault(index, Series("time_s", "updates_per_s")).append(
                time_s=t, updates_per_s=updates / interval)
            return
        if "memory_limit" in msg:
            self.memory[index] = {k: msg.get(k) for k in _MEMORY}
            self.memory_seen += 1
        samples = max(0.0, _finite(msg.get("samples")))
        data, servers = _finite(msg.get("feed_wait_s")), _finite(msg.get("server_wait_s"))
        self.samples_total += samples
        self.trainer_rate[index] = (samples / interval, now)
        # The job's rate from the trainers' own clocks: scores arrive in bursts, so rates
        # between two scores' arrivals jump about.
        self.throughput.append(time_s=t, samples_per_s=self.samples_per_s(now))
        for what, seconds in (("data", data), ("servers", servers)):
            key = (index, what)
            self.wait_total[key] = self.wait_total.get(key, 0.0) + max(0.0, seconds)
        steps = max(0.0, _finite(msg.get("steps")))
        self.trainers.setdefault(
            index, Series("time_s", "samples_per_s", "data_wait", "server_wait", "steps_per_s")
        ).append(time_s=t, samples_per_s=samples / interval, data_wait=min(1.0, data / interval),
                 server_wait=min(1.0, servers / interval),
                 steps_per_s=0.0 if math.isnan(steps) else steps / interval)

    # -- the cluster ------------------------------------------------------------------------------
    def worker_left(self, worker: str, *, now: float) -> None:
        """A worker left the cluster; noted when this running job used it."""
        if self.state == "running" and worker in self.workers:
            self.note(now, "worker", f"{worker} left the cluster")

    def client_left(self, client: str, *, now: float) -> None:
        """The job's client disconnected: a job still running ended with it (a killed kernel)."""
        if self.state == "running" and self.info.get("client") == client:
            self.state, self.stopped_by, self.ended = "failed", "its client disconnected", now
            self.note(now, "end", self.stopped_by)

    def worker_joined(self, worker: str, *, now: float) -> None:
        """A worker joined the cluster while this job runs."""
        if self.state == "running":
            self.note(now, "worker", f"{worker} joined the cluster")

    def samples_per_s(self, now: float) -> float:
        """The trainers' summed rate over their last reports (those not older than
        :data:`RATE_FRESH_S`: a trainer that ended counts no more)."""
        return sum(rate for rate, when in self.trainer_rate.values() if now - when <= RATE_FRESH_S)

    def summary(self, now: float) -> dict[str, Any]:
        """The headline figures: state, step, samples, the latest scores and rate."""
        scores = {name: s.data["value"][-1] for name, s in self.scores.items() if s.total}
        return {"job_id": self.job_id, "state": self.state, "stopped_by": self.stopped_by,
                "strategy": self.info.get("strategy", ""), "step": self.step,
                "samples": self.samples_total, "generation": self.generation,
                "failures": sum(self.failures.values()), "nonfinite": self.nonfinite,
                "scores": scores, "epoch": _finite(self.latest.get("epoch")),
                "samples_per_s": self.samples_per_s(now),
                "trainers": len(self.trainers), "servers": len(self.servers)}


# A trainer's memory figures, as its stats reports carry them.
_MEMORY = ("worker", "memory_limit", "held_bytes", "held_bytes_max", "read_s_by_epoch")

# History columns that are not validation scores.
_NOT_SCORES = {"time_s", "step", "epoch", "samples", "samples_per_s", "kind"}


def _describe_roles(roles: Mapping[str, Any]) -> str:
    counts = {name: len(addresses) for name, addresses in roles.items() if addresses}
    return ", ".join(f"{n} {name}" for name, n in counts.items()) or "no roles"


class Jobs:
    """The latest ``keep`` jobs seen on this scheduler, oldest first.

    Examples
    --------
    >>> jobs = Jobs()
    >>> jobs.event("dask-train-abc", {"kind": "start", "strategy": "sync", "roles": {}}, now=0.0)
    >>> jobs.event("dask-train-abc", {"kind": "record", "step": 10, "loss": 0.5}, now=1.0)
    >>> jobs.latest().scores["loss"].columns()
    {'time_s': [1.0], 'step': [10], 'value': [0.5]}
    """

    def __init__(self, keep: int = 10) -> None:
        self.keep = keep
        self.views: OrderedDict[str, JobView] = OrderedDict()

    def event(self, topic: str, msg: Any, *, now: float) -> None:
        """Take one event of any topic (others than dask-train's are ignored at once)."""
        parsed = parse_topic(topic) if isinstance(msg, dict) else None
        if parsed is None:
            return
        job, generation = parsed
        if generation is None:
            self._view(job, now=now, new=msg.get("kind") == "start").controller_event(msg, now=now)
        elif msg.get("kind") == "stats":
            self._view(job, now=now).stats_event(msg, generation=generation, now=now)

    def _view(self, job: str, *, now: float, new: bool = False) -> JobView:
        view = self.views.get(job)
        if view is None or (new and view.info):  # a job id seen again starts afresh
            view = self.views[job] = JobView(job, now=now)
            self.views.move_to_end(job)
            while len(self.views) > self.keep:
                self.views.popitem(last=False)
        return view

    def latest(self) -> JobView | None:
        """The job that started last."""
        return next(reversed(self.views.values()), None)

    def running(self) -> list[JobView]:
        """The jobs still running."""
        return [v for v in self.views.values() if v.state == "running"]
