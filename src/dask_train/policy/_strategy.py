"""``strategy="auto"``: async-ps, sync, or one process on one worker, from the job's measured costs.

Distributing a job pays for itself only when the work it spreads outweighs what it adds: a
message per step (async-ps: a push and its reply; sync: an all-reduce) and, on one machine, the
cores the messages take from the gradients. For a small model on a few cores one plain process
is often faster ("focusing on single machine computation is often a better use of time"), so
the three ways of running a job are predicted from the same measured costs (a
:class:`~dask_train.policy.CostModel`: a step's gradient, an optimizer step per parameter, an
echo between two workers) and the fastest is taken:

* **one process** on one worker: a step is a gradient and a local optimizer step, nothing
  sent, ``batch / (compute_s + update_s_per_param * n_params)`` samples per second. It runs as
  the sync engine with one rank: the gradients accumulate into the buffer the optimizer reads
  and the parameters are the module's own, so a step copies nothing (async-ps with one trainer
  would copy the gradient to its server and the parameters back, every step);
* **sync** with ``W`` ranks, one per Dask worker: each step every rank computes its gradient,
  then a ring all-reduce of the flat gradient (``2 (W - 1)`` messages of ``1/W`` of it each
  way: ``(W - 1) * message_s`` of fixed costs, an echo being two messages, plus
  ``2 (W - 1) / W`` of the gradient's bytes on the link), then every rank applies the whole
  update. Bounded too by the cores when the ranks share a machine;
* **async-ps** with ``W`` trainers: the cost model's own prediction, with the fewest servers
  within 10% of the best (``ps="auto"``) or the servers asked for. With the shards in host
  memory (``host_memory``) and every worker on one machine, no message is sent at all: each
  trainer applies its own update to the shared shards, so a trainer's step is its gradient and
  a whole optimizer step, each shard takes one update at a time (its lock), and the cores hold
  every trainer's step.

On one machine (``shared_cores`` set) a message costs CPU on both of its ends, taken from the
same cores the gradients need: with no measured ``cpu_s_per_message``, each end of a message is
taken to cost a quarter of an echo's round trip (two messages, each sent and received, with no
wire between them). Between hosts the model's own values hold.

Where every worker is on one machine, ``strategy="auto"`` measures each candidate's whole step
there instead (``engines.measure.step``) and passes the rates as ``measured``: they replace
the predictions.

Predictions are compared in samples per second. Within ``tolerance`` (10%) of the fastest, the
simpler wins: one process, then sync (exact gradients, no staleness), then async-ps.

Examples
--------
>>> costs = CostModel(n_params=7_510, batch_size=128, compute_s=0.0003, update_s_per_param=5e-9,
...                   link_bytes_per_s=2e9, message_s=0.0007, hosts=2, shared_cores=2.0)
>>> plan = choose_strategy(costs, workers=2, sync_workers=2, max_ps=2)
>>> plan.chosen.name, plan.chosen.strategy, plan.chosen.workers
('one-process', 'sync', 1)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from dask_train.errors import InvalidInput
from dask_train.policy._cost import CostModel, _soft_min
from dask_train.policy._settings import per_trainer_batch

#: The candidates, simplest first: the order that breaks near-ties.
CANDIDATES = ("one-process", "sync", "async-ps")


@dataclass(frozen=True)
class Candidate:
    """One way of running the job and its predicted steady-state rate.

    ``name`` is the candidate (``"one-process"``, ``"sync"``, ``"async-ps"``); ``strategy`` the
    engine that runs it (one process runs as ``"sync"`` with one rank); ``workers`` its
    trainers (ranks); ``ps`` its servers (0 without); ``batch_size`` the rows of one trainer's
    step; ``bottleneck`` what limits it.
    """

    name: str
    strategy: str
    workers: int
    ps: int
    batch_size: int
    samples_per_s: float
    bottleneck: str

    def describe(self) -> str:
        """``"sync (2 ranks): 93,000 samples/s, limited by the all-reduce"``."""
        if self.name == "one-process":
            who = "1 trainer"
        elif self.strategy == "sync":
            who = f"{self.workers} ranks"
        else:
            who = f"{self.workers} trainers, ps={self.ps}"
        return f"{self.name} ({who}): {self.samples_per_s:,.0f} samples/s, limited by " \
               f"{self.bottleneck}"


@dataclass(frozen=True)
class StrategyPlan:
    """The candidate chosen, every candidate's prediction, and the tolerance that chose it."""

    chosen: Candidate
    candidates: tuple[Candidate, ...]
    tolerance: float

    def describe(self) -> str:
        """One line for the log: the choice, then every candidate's predicted rate."""
        c = self.chosen
        runs = f"strategy={c.strategy!r}, workers={c.workers}" + (f", ps={c.ps}" if c.ps else "")
        others = "; ".join(c.describe() for c in self.candidates)
        return f"{c.name} ({runs}); predicted {others}"

    def record(self) -> dict[str, Any]:
        """A JSON-able summary (``FitResult.plan``)."""
        return {"chosen": self.chosen.name, "strategy": self.chosen.strategy,
                "workers": self.chosen.workers, "ps": self.chosen.ps,
                "predicted_samples_per_s": {c.name: round(c.samples_per_s, 1)
                                            for c in self.candidates},
                "bottlenecks": {c.name: c.bottleneck for c in self.candidates}}


def _on_one_machine(model: CostModel) -> CostModel:
    """``model`` with the CPU a message costs on one machine (see the module's description)."""
    if model.shared_cores is None or model.cpu_s_per_message > 0:
        return model
    return model.replace(cpu_s_per_message=model.message_s / 4)


def _with_batch(model: CostModel, rows: int) -> CostModel:
    """``model`` for a step of ``rows`` rows: a gradient's time taken as proportional to rows."""
    if rows == model.batch_size:
        return model
    return model.replace(batch_size=rows, compute_s=model.compute_s * rows / model.batch_size)


def one_process(model: CostModel) -> Candidate:
    """One trainer alone: its gradient and its own optimizer step, nothing sent."""
    step = model.compute_s + model.update_s_per_param * model.n_params
    rate = model.batch_size / step if step > 0 else math.inf
    return Candidate("one-process", "sync", 1, 0, model.batch_size, rate, "compute")


def sync_ranks(model: CostModel, *, workers: int) -> Candidate:
    """``workers`` ranks stepping together on a ring all-reduce (see the module's description)."""
    w = workers
    nbytes = model.bytes_per_param * model.n_params
    rate = model.link_bytes_per_s * model.link_efficiency
    work = model.compute_s + model.update_s_per_param * model.n_params
    reduce_s = (w - 1) * (model.message_s + 2 * model.latency_s) + 2 * (w - 1) / w * nbytes / rate
    # A step's gradient, then its all-reduce (one bucket for a small model: nothing overlaps).
    bounds = {"the all-reduce": 1 / (work + reduce_s) if work + reduce_s > 0 else math.inf}
    # Each rank sends and receives 2 (w - 1) messages a step; each costs CPU at both ends.
    message_cpu = model.cpu_s_per_message + nbytes / w * model.cpu_s_per_byte
    per_rank_cpu = work + 4 * (w - 1) * message_cpu
    if model.shared_cores is not None:
        bounds["cores"] = model.shared_cores / (w * per_rank_cpu)
    else:
        bounds["cores"] = model.cores_per_host / per_rank_cpu
    steps = _soft_min(bounds.values(), model.sharpness)
    limit = min(bounds, key=lambda k: bounds[k])
    return Candidate("sync", "sync", w, 0, model.batch_size, steps * w * model.batch_size, limit)


def async_ps(model: CostModel, *, workers: int, ps: int | None, max_ps: int) -> Candidate:
    """``workers`` trainers on the cost model's servers: ``ps``, or its recommendation."""
    if ps is None:
        predicted = model.recommend_ps(workers=workers, max_ps=max(1, max_ps)).predicted
    else:
        predicted = model.predict(workers=workers, ps=ps)
    return Candidate("async-ps", "async-ps", workers, predicted.ps, model.batch_size,
                     predicted.samples_per_s, predicted.bottleneck)


def async_ps_host_memory(model: CostModel, *, workers: int, ps: int | None, max_ps: int,
                         tolerance: float = 0.1) -> Candidate:
    """``workers`` trainers of one machine updating the shards in host memory themselves; with
    ``ps=None`` the fewest shards within ``tolerance`` of the best."""
    update = model.update_s_per_param * model.n_params
    work = model.compute_s + update
    cores = model.shared_cores if model.shared_cores is not None else model.cores_per_host

    def predict(k: int) -> tuple[float, str]:
        bounds = {"trainers": workers / work if work > 0 else math.inf,
                  # A shard's lock: one update of 1/k of the parameters at a time, one a step.
                  "servers": k / update if update > 0 else math.inf,
                  "cores": cores / work if work > 0 else math.inf}
        return _soft_min(bounds.values(), model.sharpness), min(bounds, key=lambda b: bounds[b])

    counts = [ps] if ps is not None else list(range(1, max(1, max_ps) + 1))
    rates = {k: predict(k) for k in counts}
    best = max(steps for steps, _ in rates.values())
    k = next(k for k in counts if rates[k][0] >= (1 - tolerance) * best)
    steps, limit = rates[k]
    return Candidate("async-ps", "async-ps", workers, k, model.batch_size,
                     steps * model.batch_size, limit)


def choose_strategy(model: CostModel, *, workers: int, sync_workers: int, max_ps: int,
                    ps: int | None = None, global_batch: int | None = None,
                    host_memory: bool = False, tolerance: float = 0.1,
                    measured: Mapping[str, float] | None = None) -> StrategyPlan:
    """The fastest way to run a job whose costs ``model`` holds; near-ties to the simpler.

    Parameters
    ----------
    model : CostModel
        The measured costs of one trainer's step (``model.batch_size`` rows).
    workers : int
        Trainers asked for (async-ps's trainers, sync's ranks).
    sync_workers : int
        Ranks sync can have: at most one per Dask worker. Below 2, sync is one process.
    max_ps : int
        Most servers ``ps="auto"`` may take (the Dask workers).
    ps : int, optional
        The servers asked for; None: the cost model's recommendation.
    global_batch : int, optional
        Rows of one step over all trainers (``global_batch_size``): each of ``W`` trainers then
        takes ``global_batch // W``; None: every trainer takes ``model.batch_size``.
    host_memory : bool
        Whether async-ps shards live in host memory that trainers of their machine update
        themselves (``engines.holders.host_memory``); it changes async-ps only when every worker
        is on one machine (``model.shared_cores`` set).
    tolerance : float
        A simpler candidate within this fraction of the fastest is taken instead.
    measured : mapping, optional
        Candidate name -> samples per second of its whole step measured on the machine
        (``engines.measure.step``): used instead of the prediction for those candidates.

    Returns
    -------
    StrategyPlan
    """
    problems = [f"{name}={value!r} is invalid: use an integer >= 1." for name, value in
                (("workers", workers), ("sync_workers", sync_workers), ("max_ps", max_ps))
                if isinstance(value, bool) or not isinstance(value, int) or value < 1]
    if not 0 <= tolerance < 1:
        problems.append(f"tolerance={tolerance!r} is invalid: use a number in [0, 1).")
    if problems:
        raise InvalidInput(problems)
    model = _on_one_machine(model)

    def rows(w: int) -> int:
        return per_trainer_batch(model.batch_size, global_batch, w)

    candidates = [one_process(_with_batch(model, rows(1)))]
    ranks = min(workers, sync_workers)
    if ranks >= 2:
        candidates.append(sync_ranks(_with_batch(model, rows(ranks)), workers=ranks))
    if host_memory and model.shared_cores is not None:
        candidates.append(async_ps_host_memory(_with_batch(model, rows(workers)),
                                               workers=workers, ps=ps, max_ps=max_ps))
    else:
        candidates.append(async_ps(_with_batch(model, rows(workers)), workers=workers, ps=ps,
                                   max_ps=max_ps))
    for name, rate in (measured or {}).items():
        if not (isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)):
            raise InvalidInput([f"measured[{name!r}]={rate!r} is invalid: use samples per "
                                "second, a finite number > 0."])
    candidates = [c if c.name not in (measured or {}) else
                  replace(c, samples_per_s=float((measured or {})[c.name]),
                          bottleneck="its whole step, measured on this machine")
                  for c in candidates]
    best = max(c.samples_per_s for c in candidates)
    chosen = next(c for c in candidates if c.samples_per_s >= (1 - tolerance) * best)
    return StrategyPlan(chosen=chosen, candidates=tuple(candidates), tolerance=tolerance)
