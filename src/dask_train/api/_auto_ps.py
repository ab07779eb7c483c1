"""``ps="auto"``: the number of parameter servers, chosen by the cost model at fit time.

Before the roles are placed, the job's per-step costs are measured on the cluster (a few
gradients of the module on one batch, an optimizer step, an echo between two workers: see
``engines.measure.ps_costs``); the cost model (``policy._cost``) predicts the throughput of each server
count from 1 to the number of Dask workers, and the fewest servers within 10% of the best are
taken. The choice, its predicted rate and what limits it are logged at INFO.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from distributed import Client

if TYPE_CHECKING:
    from dask_train.api._plan import FitPlan

logger = logging.getLogger("dask_train.api")

AUTO = "auto"


def resolve_ps(plan: FitPlan, client: Client, X: Any, y: Any) -> tuple[int, dict[str, Any]]:
    """The server count for this fit: its ``ps`` itself unless it is ``"auto"``; and what
    ``FitResult.plan`` says of it (with ``"auto"``, the predicted rate and its bottleneck).

    ``X`` and ``y`` are the training dask arrays (one batch of them is computed for the probe).
    A sync job has no servers, so ``"auto"`` costs nothing there.
    """
    s = plan.settings
    if s.ps != AUTO:
        return int(s.ps), {}
    if s.strategy == "sync":
        return 0, {}
    from dask_train.runtime._roles import trainer_workers, worker_threads

    model, probe_s = probe_model(plan, client, X, y)
    threads = worker_threads(client)
    workers = s.cluster.trainers(len(trainer_workers(client, s.cluster.placement)))
    choice = model.recommend_ps(workers=workers, max_ps=max(1, len(threads)))
    logger.info("ps='auto': %s (compute %.1f ms a step, link %.0f MB/s, %d parameters)",
                choice.describe(), model.compute_s * 1e3, model.link_bytes_per_s / 1e6,
                model.n_params)
    return choice.ps, {"predicted_samples_per_s": {"async-ps": choice.predicted.samples_per_s},
                       "bottlenecks": {"async-ps": choice.predicted.bottleneck},
                       "probe_s": round(probe_s, 4)}


def probe_model(plan: FitPlan, client: Client, X: Any, y: Any, *, cores: bool = False
                ) -> tuple[Any, float]:
    """The job's :class:`~dask_train.policy.CostModel` measured on the cluster (a few gradients
    of one trainer's batch, an optimizer step, an echo between two workers), and the seconds
    it took. With ``cores``, when every worker is on one machine, ``shared_cores`` is the cores
    the trainers really get there now (``engines.measure.cores``), not the machine's count.
    """
    import time

    from dask_train.engines.measure.ps_costs import probe_costs
    from dask_train.runtime._roles import ensure_plugin, worker_threads

    started = time.perf_counter()
    n, settings = probe_arguments(plan, n_rows=int(X.shape[0]))
    xb, yb = (np.asarray(a) for a in client.compute([X[:n], y[:n]], sync=True))
    ensure_plugin(client)
    workers = sorted(worker_threads(client))
    modules = shipped_modules(plan, client, workers if cores else workers[:1])
    try:
        model = probe_costs(client, cast(Any, modules[workers[0]]), xb, yb, **settings)
        if cores and model.shared_cores is not None and len(workers) > 1:
            model = model.replace(shared_cores=_cores_got(
                client, modules, xb, yb, loss=plan.settings.model.loss,
                most=model.shared_cores, timeout=float(plan.settings.cluster.timeout)))
    finally:
        for future in modules.values():
            future.release()
    return model, time.perf_counter() - started


def shipped_modules(plan: FitPlan, client: Client, workers: list[str]) -> dict[str, Any]:
    """Per worker, a future of the fit's model unpacked there (release them after use)."""
    from dask_train.models._transport import travelling, unwrap

    payload = travelling(plan.model, factory=plan.factory)
    # The module reaches each worker as it reaches the job's roles (a class of the user's own
    # file by value, a weight-normed module through its factory) and is unpacked there, where
    # the probe runs: sent as it is, Dask's serializer of a module would name its class, which
    # a worker without the user's file cannot import.
    return {w: client.submit(unwrap, payload, workers=[w], pure=False) for w in workers}


def _cores_got(client: Client, modules: dict[str, Any], x: np.ndarray, y: np.ndarray, *,
               loss: Any, most: float, timeout: float, duration_s: float = 0.06) -> float:
    """The cores a job's trainers get on this one machine now: their steps per second on every
    worker at once over one worker's alone (at least 1, at most the machine's ``most``)."""
    import time

    from dask_train.engines.measure.cores import step_rate_task

    def rates(where: list[str]) -> list[float]:
        start = time.time() + 0.03  # every task ready before the common start
        futures = [client.submit(step_rate_task, modules[w], x, y, loss=loss, start_at=start,
                                 duration_s=duration_s, workers=[w], pure=False) for w in where]
        return [float(f.result(timeout)) for f in futures]

    alone = rates(sorted(modules)[:1])[0]
    together = sum(rates(sorted(modules)))
    return float(min(most, max(1.0, together / alone))) if alone > 0 else most


def probe_arguments(plan: FitPlan, *, n_rows: int) -> tuple[int, dict[str, Any]]:
    """``(rows, settings)`` of the probe: the rows of the batch it measures (one trainer's batch,
    at most the data's ``n_rows``) and the keyword arguments of
    :func:`~dask_train.engines.measure.ps_costs.probe_costs` from the fit's settings.

    The batch is the one each trainer will run (:meth:`FitPlan.per_trainer_batch`), so with
    ``global_batch_size`` it is that divided by ``workers``, not ``batch_size``.
    """
    m = plan.settings.model
    # A prefetch the trainers choose as they run ("auto") starts from one push in flight.
    # Measured for the trainers asked for: strategy="auto" scales it to each candidate's batch.
    prefetch = m.prefetch if isinstance(m.prefetch, (int, bool)) else 1
    rows = min(int(n_rows), int(plan.per_trainer_batch()))
    return rows, {"loss": m.loss, "optim": m.optim(), "prefetch": int(prefetch),
                  "grad_accumulation": int(m.grad_accumulation),
                  "timeout": float(plan.settings.cluster.timeout)}
