"""What a torch fit runs: its strategy, trainers and servers, with ``strategy="auto"`` resolved.

``strategy="auto"`` measures the job's costs on the cluster once, as ``ps="auto"`` does (a few
gradients of one trainer's batch, an optimizer step, an echo between two workers: 0.03-0.3 s on
the digits MLP), and :func:`~dask_train.policy._strategy.choose_strategy` predicts one process,
sync and async-ps from them and takes the fastest (near-ties to the simpler). The choice and
every candidate's predicted samples per second are logged at INFO and kept in
``FitResult.plan``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from distributed import Client

from dask_train.api._auto_ps import AUTO, probe_model, resolve_ps
from dask_train.api._plan import Choice, FitPlan

logger = logging.getLogger("dask_train.api")

#: Why ``strategy="auto"`` is sync on GPU workers, as measured (``benchmarks/gpu.py``).
GPU_ASYNC_PS_MEASURED = ("on one NVIDIA H200 the 34 M-parameter MLP trained at 0.04x plain "
                         "torch's steps a second with async-ps, 0.92x with sync "
                         "(benchmarks/gpu.py, 2026-11-28)")


def host_memory_shards() -> bool:
    """Whether async-ps keeps its shards in host memory, where the trainers of their machine
    update them without a message (``engines.holders.host_memory``, on unless Dask's config
    ``dask-train.host-memory`` is false). Read in the client: workers started with another
    config decide for themselves."""
    import importlib.util

    import dask

    if importlib.util.find_spec("dask_train.engines.holders.host_memory") is None:
        return False
    return bool(dask.config.get("dask-train.host-memory", True))


def choose(plan: FitPlan, client: Client, X: Any, y: Any, *, device_kind: str = "cpu") -> Choice:
    """How ``plan``'s fit runs on ``client``'s cluster: its settings as given, or with
    ``strategy="auto"`` (and ``ps="auto"``) the measured choice. ``X`` and ``y`` are the
    training dask arrays (the probe computes one batch of them). On GPU workers
    (``device_kind="cuda"``) "auto" is sync, one rank a worker, with the reason in the log."""
    from dask_train.runtime._roles import trainer_workers

    s = plan.settings
    # The workers that may hold a trainer: every worker, or those with the job's resources.
    usable = trainer_workers(client, s.cluster.placement)
    workers = s.cluster.trainers(len(usable))
    if s.strategy != AUTO:
        ps, noted = resolve_ps(plan, client, X, y)
        strategy = str(s.strategy)
        ps = 0 if strategy == "sync" else ps  # sync has no servers, whatever ps says
        return Choice(strategy, workers, ps, {"strategy": strategy, "workers": workers,
                                              "ps": ps, **noted})
    if device_kind == "cuda":
        workers = min(workers, len(usable))  # one rank a worker process
        logger.info("strategy='auto': sync on %d GPU workers. async-ps's servers keep the "
                    "parameters and optimizer state in host memory, so each of its steps "
                    "copies the gradients off the GPU and the parameters back: %s", workers,
                    GPU_ASYNC_PS_MEASURED)
        return Choice("sync", workers, 0, {"strategy": "sync", "workers": workers, "ps": 0,
                                           "reason": "GPU workers"})
    from dask_train.policy._strategy import choose_strategy

    model, probe_s = probe_model(plan, client, X, y, cores=True)
    addresses = sorted(usable)
    measured: dict[str, float] = {}
    if model.shared_cores is not None and len(addresses) > 1 and host_memory_shards():
        # One machine: the candidates' whole steps measured there, not predicted.
        from dask_train.api._auto_measure import measure_candidates

        started = time.perf_counter()
        measured = measure_candidates(plan, client, X, y, workers=addresses)
        probe_s += time.perf_counter() - started
    made = choose_strategy(
        model, workers=workers, sync_workers=len(addresses),
        max_ps=max(1, len(addresses)), ps=None if s.ps == AUTO else int(s.ps),
        global_batch=None if s.data.global_batch_size is None else int(s.data.global_batch_size),
        host_memory=host_memory_shards(), measured=measured,
    )
    cores = model.shared_cores if model.shared_cores is not None else model.cores_per_host
    logger.info("strategy='auto': %s; probed in %.2f s (compute %.2f ms a step of %d rows, "
                "echo %.2f ms, %d parameters, %.1f cores for the trainers%s)", made.describe(),
                probe_s, model.compute_s * 1e3, model.batch_size, model.message_s * 1e3,
                model.n_params, cores, "" if model.shared_cores is not None else " a host")
    chosen = made.chosen
    return Choice(chosen.strategy, chosen.workers, chosen.ps,
                  {**made.record(), "probe_s": round(probe_s, 4), "cores": round(cores, 2)})
