"""A cost model of asynchronous parameter-server training: throughput from a few per-step costs.

How many parameter servers does a job need? Each step a trainer computes one batch's gradient
(``compute_s``), sends each server its slice of the gradient and receives the slice of new
parameters back (``bytes_per_param * n_params / ps`` each way per server), and every server applies
one optimizer step to its slice (``update_s_per_param * n_params / ps``). Trainers keep
``prefetch`` exchanges in flight while they compute, so communication hides behind computation
up to that depth.

Each resource bounds the throughput of the whole job (steps per second, all trainers together):
its capacity over what one step asks of it (asymptotic bound analysis, as in operational queueing
theory):

* **trainers**: each trainer makes at most one step per *cycle*: ``compute_s + round_trip`` with
  no prefetch, ``max(compute_s, round_trip / prefetch)`` with it, where a round trip is
  ``2 * latency_s + message_s + server update + bytes out / link + bytes back / link`` plus
  the CPU both ends spend on its messages (``cpu_s_per_message``, ``cpu_s_per_byte``), less
  the part of the replies that travel while later pushes are still being sent (``overlap``: 0
  when the pushes to several servers share the trainer's link fairly and finish together, 1
  when they go one after another and each reply follows its push at once);
* **links**: every host's link carries, each way, ``link_bytes_per_s``; a step puts a shard's
  bytes on the trainer's and the server's links unless both roles share the host;
* **servers**: a shard applies one update at a time, so the job makes at most
  ``1 / (update time + handling a push and its reply)`` steps per second however many trainers
  push;
* **cores**: each host has ``cores_per_host`` cores for its trainers' gradients, its servers'
  updates and the handling of every message sent or received (``cpu_s_per_message`` plus
  ``cpu_s_per_byte`` for each byte); or, for many emulated hosts on one machine (network
  namespaces, a LocalCluster), all hosts share ``shared_cores``.

The prediction is the bounds' soft minimum, ``(sum of bound ** -sharpness) ** (-1 / sharpness)``:
near the smallest bound alone when one resource limits by far, and below it where several are
close, as queues build at a resource that nears saturation (an infinite ``sharpness`` gives the
plain minimum of bound analysis, which is reached only with no queueing at all).

Roles are placed as :func:`~dask_train.policy.plan_roles` places them: trainers first, one per host,
then servers on the least-loaded hosts; ``hosts=None`` gives every role a host of its own.

The model is calibrated on the cluster at hand in two ways: the per-step costs are measured
directly (a gradient, an optimizer step, an echo between two workers: see
``dask_train.engines.measure.ps_costs``), and :func:`calibrate` fits the remaining factors (how much of the
link rate a transfer really gets, the fixed cost per exchange, ...) to a few measured
throughputs. It then predicts other worker and server counts, up to thousands of workers, and
:meth:`CostModel.recommend_ps` picks a server count.

Examples
--------
>>> model = CostModel(n_params=1_000_000, batch_size=128, compute_s=0.004,
...                   update_s_per_param=4e-9, link_bytes_per_s=125e6)   # 1 Gbit/s
>>> round(model.predict(workers=1, ps=1).steps_per_s, 1)
14.2
>>> model.recommend_ps(workers=8).ps
5
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dask_train.errors import InvalidInput

# Factors calibrate() may fit, and how far from their starting value it searches (a factor of
# 10**SPAN each way, in log space).
FITTABLE = ("link_efficiency", "message_s", "cpu_s_per_message", "overlap", "sharpness",
            "compute_s", "update_s_per_param", "cpu_s_per_byte")
_SPAN = 2.0


@dataclass(frozen=True)
class Prediction:
    """Predicted steady-state rate of one (workers, ps) setting and what limits it."""

    workers: int
    ps: int
    steps_per_s: float
    samples_per_s: float
    bottleneck: str  # "trainers", "links", "servers" or "cores"
    bounds: Mapping[str, float]  # each resource's bound in steps/s


@dataclass(frozen=True)
class Recommendation:
    """The server count chosen for a number of trainers, with every count's prediction."""

    ps: int
    workers: int
    predicted: Prediction
    candidates: tuple[Prediction, ...]

    def describe(self) -> str:
        """One line for a log: the choice, its predicted rate, the bottleneck, one server's rate."""
        one = next((p for p in self.candidates if p.ps == 1), None)
        text = (f"ps={self.ps} for {self.workers} trainers: predicted "
                f"{self.predicted.samples_per_s:,.0f} samples/s, limited by "
                f"{self.predicted.bottleneck}")
        if one is not None and self.ps != 1:
            text += f" (ps=1: {one.samples_per_s:,.0f} samples/s, limited by {one.bottleneck})"
        return text


@dataclass(frozen=True)
class Measured:
    """A throughput measured on the cluster, to calibrate against."""

    workers: int
    ps: int
    steps_per_s: float


@dataclass(frozen=True)
class CostModel:
    """Per-step costs of an async-ps job; predicts its throughput for any worker and server count.

    Parameters
    ----------
    n_params : int
        Parameters of the model (the length of the flat vector the servers split).
    batch_size : int
        Samples per step (per push: ``batch_size * grad_accumulation``).
    compute_s : float
        Seconds a trainer spends on one step's gradients (forward, backward, cutting the batch).
    update_s_per_param : float
        Seconds a server's optimizer step takes per parameter (Adam: a few ns).
    link_bytes_per_s : float
        Each host's link rate, each direction, in bytes per second.
    latency_s : float
        One-way latency between two hosts.
    message_s : float
        Fixed cost of one exchange with a server besides latency and transfer (RPC, event loops).
    link_efficiency : float
        The share of ``link_bytes_per_s`` a transfer gets (TCP and framing overhead).
    bytes_per_param : int
        4 for float32.
    prefetch : int
        Exchanges a trainer keeps in flight while it computes (the Trainer's ``prefetch``).
    hosts : int, optional
        Hosts the roles are placed on (one Dask worker each); None: each role on its own host.
    cores_per_host : float
        Cores of each host.
    shared_cores : float, optional
        Cores shared by all hosts (several emulated hosts on one machine); None: not shared.
    cpu_s_per_message : float
        CPU seconds a host spends on each message it sends or receives (an RPC through the
        worker's event loop, framing), on top of its bytes.
    cpu_s_per_byte : float
        CPU seconds per byte sent or received (copies and serialization), on both ends.
    overlap : float
        In [0, 1]: how much of a trainer's replies travel while its later pushes are still
        being sent (see the module's description); 0 is fair sharing.
    sharpness : float
        Exponent of the soft minimum of the bounds; ``math.inf`` for the plain minimum. The
        default 3 fits ``benchmarks/multihost.py``'s measurements.
    """

    n_params: int
    batch_size: int
    compute_s: float
    update_s_per_param: float
    link_bytes_per_s: float
    latency_s: float = 0.0
    message_s: float = 0.0
    link_efficiency: float = 1.0
    bytes_per_param: int = 4
    prefetch: int = 1
    hosts: int | None = None
    cores_per_host: float = 1.0
    shared_cores: float | None = None
    cpu_s_per_message: float = 0.0
    cpu_s_per_byte: float = 0.0
    overlap: float = 0.0
    sharpness: float = 3.0

    def __post_init__(self) -> None:
        problems = []
        for name in ("n_params", "batch_size", "bytes_per_param"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} is invalid: use an integer >= 1.")
        for name in ("compute_s", "update_s_per_param", "latency_s", "message_s",
                     "cpu_s_per_message", "cpu_s_per_byte"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                problems.append(f"{name}={value!r} is invalid: use a finite number >= 0.")
        for name in ("link_bytes_per_s", "link_efficiency", "cores_per_host"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                problems.append(f"{name}={value!r} is invalid: use a number > 0.")
        if not (isinstance(self.overlap, (int, float)) and 0 <= self.overlap <= 1):
            problems.append(f"overlap={self.overlap!r} is invalid: use a number in [0, 1].")
        if not (isinstance(self.sharpness, (int, float)) and self.sharpness >= 1):
            problems.append(f"sharpness={self.sharpness!r} is invalid: use a number >= 1 or math.inf.")
        if self.shared_cores is not None and not self.shared_cores > 0:
            problems.append(f"shared_cores={self.shared_cores!r} is invalid: use a number > 0 or None.")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            problems.append(f"prefetch={self.prefetch!r} is invalid: use an integer >= 0.")
        if self.hosts is not None and (not isinstance(self.hosts, int) or self.hosts < 1):
            problems.append(f"hosts={self.hosts!r} is invalid: use an integer >= 1 or None.")
        if problems:
            raise InvalidInput(problems)

    def replace(self, **changes: object) -> CostModel:
        """A copy with some fields changed (``model.replace(n_params=10**8)``)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    # -- predictions -----------------------------------------------------------------------------

    def predict(self, *, workers: int, ps: int) -> Prediction:
        """Steady-state steps and samples per second of ``workers`` trainers and ``ps`` servers."""
        if workers < 1 or ps < 1:
            raise InvalidInput([f"workers={workers}, ps={ps} are invalid: use integers >= 1."])
        kinds = Counter(zip(*place(workers=workers, ps=ps, hosts=self.hosts)))
        shard_bytes = self.bytes_per_param * self.n_params / ps
        update_s = self.update_s_per_param * self.n_params / ps
        message_cpu = self.cpu_s_per_message + shard_bytes * self.cpu_s_per_byte
        cycle_rate = 0.0
        link_load = 0.0  # the busiest link's bytes per step, one direction
        cpu_load: list[tuple[float, int]] = []  # (CPU seconds per step, hosts like it)
        for (t, k), n in kinds.items():
            # Per step (one push by one trainer, each trainer pushing 1/workers of them): messages
            # into this host = pushes from other hosts' trainers to its shards + replies to its
            # trainers from other hosts' shards; as many go out.
            messages = k * (workers - t) / workers + t / workers * (ps - k)
            link_load = max(link_load, messages * shard_bytes)
            if self.shared_cores is not None or t + k > 1:
                # A host with one role only has a core to itself: the trainers' and servers'
                # own bounds already hold its work (counting it twice would lower the soft min).
                cpu_load.append((t / workers * self.compute_s + k * update_s
                                 + 2 * messages * message_cpu, n))
            if t:
                cycle_rate += n * t / self._cycle(away=ps - k, shard_bytes=shard_bytes,
                                                  update_s=update_s, message_cpu=message_cpu)
        rate = self.link_bytes_per_s * self.link_efficiency
        bounds = {
            "trainers": cycle_rate,
            "links": rate / link_load if link_load > 0 else math.inf,
            "servers": 1 / (update_s + 2 * message_cpu) if update_s + message_cpu > 0 else math.inf,
            "cores": _cores_bound(cpu_load, self.cores_per_host, self.shared_cores),
        }
        bottleneck = min(bounds, key=lambda name: bounds[name])
        steps = _soft_min(bounds.values(), self.sharpness)
        return Prediction(workers=workers, ps=ps, steps_per_s=steps,
                          samples_per_s=steps * self.batch_size, bottleneck=bottleneck,
                          bounds=bounds)

    def _cycle(self, *, away: int, shard_bytes: float, update_s: float, message_cpu: float
               ) -> float:
        """Seconds between one trainer's steps, alone; ``away`` of the shards on other hosts."""
        hidden = self.overlap * (away - 1) / away if away else 0.0
        transfer = (2 - hidden) * away * shard_bytes / (self.link_bytes_per_s * self.link_efficiency)
        # The trainer handles its pushes and their replies on its own event loop, one at a time;
        # a server the one push and its reply (the servers in parallel).
        handling = 2 * away * message_cpu + (2 * message_cpu if away else 0.0)
        trip = 2 * self.latency_s + self.message_s + update_s + transfer + handling
        if self.prefetch == 0:
            return self.compute_s + trip
        return max(self.compute_s, trip / self.prefetch, 1e-12)

    def curve(self, workers: Iterable[int], *, ps: int) -> list[Prediction]:
        """Predictions for each worker count at a fixed server count."""
        return [self.predict(workers=w, ps=ps) for w in workers]

    def recommend_ps(self, *, workers: int, max_ps: int | None = None,
                     tolerance: float = 0.1) -> Recommendation:
        """The fewest servers whose predicted rate is within ``tolerance`` of the best.

        Servers cost hosts (or CPU on the trainers' hosts), so more are taken only when they buy
        more than ``tolerance`` of throughput: near a bottleneck the soft minimum keeps rising
        slowly with more servers (less queueing), which is rarely worth a host each. Candidates
        run from 1 to ``max_ps`` (default: ``workers``, at least 1, at most 256).
        """
        top = max_ps if max_ps is not None else min(max(workers, 1), 256)
        candidates = tuple(self.predict(workers=workers, ps=p) for p in range(1, max(top, 1) + 1))
        best = max(p.steps_per_s for p in candidates)
        chosen = next(p for p in candidates if p.steps_per_s >= (1 - tolerance) * best)
        return Recommendation(ps=chosen.ps, workers=workers, predicted=chosen,
                              candidates=candidates)


def _soft_min(values: Iterable[float], sharpness: float) -> float:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.inf
    low = min(finite)
    if math.isinf(sharpness) or low <= 0:
        return low
    # Scaled by the smallest, so large and tiny bounds neither overflow nor underflow.
    return low * sum((low / v) ** sharpness for v in finite) ** (-1 / sharpness)


def _cores_bound(loads: Sequence[tuple[float, int]], per_host: float, shared: float | None
                 ) -> float:
    if shared is not None:
        total = sum(load * n for load, n in loads)
        return shared / total if total > 0 else math.inf
    busiest = max((load for load, _ in loads), default=0.0)
    return per_host / busiest if busiest > 0 else math.inf


def place(*, workers: int, ps: int, hosts: int | None) -> tuple[list[int], list[int]]:
    """Trainers and servers on each host, as ``plan_roles`` places them (one Dask worker a host).

    Trainers first, on the least-loaded host (a trainer weighs 1, a server 0.5), ties to the
    lower host index, which is ``plan_roles``'s address order for equally threaded workers. A
    heap instead of ``plan_roles``'s scan, so a thousand workers cost milliseconds.

    Examples
    --------
    >>> place(workers=2, ps=1, hosts=2)
    ([1, 1], [1, 0])
    >>> place(workers=2, ps=2, hosts=None)
    ([1, 1, 0, 0], [0, 0, 1, 1])
    """
    if hosts is None:  # every role on a host of its own
        return [1] * workers + [0] * ps, [0] * workers + [1] * ps
    n = hosts
    trainers, servers = [0] * n, [0] * n
    heap = [(0.0, i) for i in range(n)]
    for count, weight, tally in ((workers, 1.0, trainers), (ps, 0.5, servers)):
        for _ in range(count):
            load, i = heapq.heappop(heap)
            tally[i] += 1
            heapq.heappush(heap, (load + weight, i))
    return trainers, servers


# -- calibration ------------------------------------------------------------------------------------


def calibrate(model: CostModel, points: Sequence[Measured], *,
              fit: Sequence[str] = ("link_efficiency", "message_s")) -> CostModel:
    """Fit some of the model's factors to measured throughputs; return the fitted model.

    Minimizes the mean squared log error between predicted and measured steps per second by a
    coordinate search in log space, each factor within a factor of 100 of its starting value
    (``message_s`` and ``cpu_s_per_byte``, which may start at 0, from a small floor). Pure
    Python: a handful of factors and points need no optimizer library.

    Parameters
    ----------
    model : CostModel
        The measured per-step costs, the starting point.
    points : sequence of Measured
        At least as many points as factors to fit.
    fit : sequence of str
        Names from :data:`FITTABLE`.

    Examples
    --------
    >>> truth = CostModel(n_params=10**6, batch_size=64, compute_s=0.002, update_s_per_param=3e-9,
    ...                   link_bytes_per_s=12.5e6, link_efficiency=0.8, message_s=0.003)
    >>> points = [Measured(w, p, truth.predict(workers=w, ps=p).steps_per_s)
    ...           for w, p in [(1, 1), (4, 1), (4, 4)]]
    >>> guess = truth.replace(link_efficiency=1.0, message_s=0.0)
    >>> round(calibrate(guess, points).link_efficiency, 2)
    0.8
    """
    problems = [f"fit={name!r} is unknown: use names from {FITTABLE}." for name in fit
                if name not in FITTABLE]
    if len(points) < max(1, len(fit)):
        problems.append(f"{len(points)} measured points cannot fit {len(fit)} factors: "
                        "measure at least one point per factor.")
    problems += [f"points[{i}] has steps_per_s={p.steps_per_s!r}: use measured rates > 0."
                 for i, p in enumerate(points) if not p.steps_per_s > 0]
    if problems:
        raise InvalidInput(problems)
    floors = {"message_s": 1e-4, "cpu_s_per_message": 1e-5, "cpu_s_per_byte": 1e-11,
              "compute_s": 1e-5,
              "update_s_per_param": 1e-11, "link_efficiency": 0.05, "overlap": 0.01,
              "sharpness": 1.0}
    ceilings = {"link_efficiency": 1.0, "overlap": 1.0, "sharpness": 50.0}
    start = {name: max(float(getattr(model, name)), floors[name]) for name in fit}
    # Each factor as log10 of its ratio to the start, within its floor and ceiling.
    start = {name: min(value, ceilings.get(name, math.inf)) for name, value in start.items()}
    lows = {name: max(-_SPAN, math.log10(floors[name] / start[name])) for name in fit}
    highs = {name: min(_SPAN, math.log10(ceilings[name] / start[name]))
             if name in ceilings else _SPAN for name in fit}

    def values(x: Mapping[str, float]) -> dict[str, float]:
        return {n: min(start[n] * 10 ** x[n], ceilings.get(n, math.inf)) for n in fit}

    def loss(x: Mapping[str, float]) -> float:
        trial = model.replace(**values(x))
        errs = [math.log(trial.predict(workers=p.workers, ps=p.ps).steps_per_s / p.steps_per_s)
                for p in points]
        return sum(e * e for e in errs) / len(errs)

    x = {name: 0.0 for name in fit}
    for step in (0.5, 0.1, 0.02, 0.004, 0.001):  # ever finer grids around the best so far
        for _ in range(20):
            improved = False
            for name in fit:
                best = loss(x)
                for cand in (x[name] + k * step for k in range(-5, 6)):
                    trial = {**x, name: min(max(cand, lows[name]), highs[name])}
                    value = loss(trial)
                    if value < best - 1e-12:
                        best, x, improved = value, trial, True
            if not improved:
                break
    return model.replace(**values(x))


def relative_errors(model: CostModel, points: Iterable[Measured]) -> list[float]:
    """(predicted - measured) / measured for each point."""
    return [model.predict(workers=p.workers, ps=p.ps).steps_per_s / p.steps_per_s - 1
            for p in points]
