"""``ps="auto"``: the number of parameter servers, chosen by the cost model at fit time.

Before the roles are placed, the job's per-step costs are measured on the cluster (a few
gradients of the module on one batch, an optimizer step, an echo between two workers: see
``engines.ps.probe``); the cost model (``policy._cost``) predicts the throughput of each server
count from 1 to the number of Dask workers, and the fewest servers within 10% of the best are
taken. The choice, its predicted rate and what limits it are logged at INFO.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import numpy as np
from distributed import Client

logger = logging.getLogger("dask_train.api")

AUTO = "auto"


def resolve_ps(trainer: Any, client: Client, X: Any, y: Any) -> tuple[int, dict[str, Any]]:
    """The server count for this fit: ``trainer.ps`` itself unless it is ``"auto"``; and what
    ``FitResult.plan`` says of it (with ``"auto"``, the predicted rate and its bottleneck).

    ``X`` and ``y`` are the training dask arrays (one batch of them is computed for the probe).
    A sync job has no servers, so ``"auto"`` costs nothing there.
    """
    if trainer.ps != AUTO:
        return int(trainer.ps), {}
    if trainer.strategy == "sync":
        return 0, {}
    from dask_train.runtime._roles import worker_threads

    model, probe_s = probe_model(trainer, client, X, y)
    workers = int(trainer.workers)
    choice = model.recommend_ps(workers=workers, max_ps=max(1, len(worker_threads(client))))
    logger.info("ps='auto': %s (compute %.1f ms a step, link %.0f MB/s, %d parameters)",
                choice.describe(), model.compute_s * 1e3, model.link_bytes_per_s / 1e6,
                model.n_params)
    return choice.ps, {"predicted_samples_per_s": {"async-ps": choice.predicted.samples_per_s},
                       "bottlenecks": {"async-ps": choice.predicted.bottleneck},
                       "probe_s": round(probe_s, 4)}


def probe_model(trainer: Any, client: Client, X: Any, y: Any) -> tuple[Any, float]:
    """The job's :class:`~dask_train.policy.CostModel` measured on the cluster (a few gradients
    of one trainer's batch, an optimizer step, an echo between two workers), and the seconds
    it took."""
    import time

    from dask_train.api._model import is_factory
    from dask_train.engines.ps.probe import probe_costs
    from dask_train.models._transport import travelling, unwrap
    from dask_train.runtime._roles import ensure_plugin, worker_threads

    started = time.perf_counter()
    n, settings = probe_arguments(trainer, n_rows=int(X.shape[0]))
    xb, yb = (np.asarray(a) for a in client.compute([X[:n], y[:n]], sync=True))
    factory = trainer.module if is_factory(trainer.module) else None
    # The module reaches the probe's worker as it reaches the job's roles (a class of the user's
    # own file by value, a weight-normed module through its factory), unpacked there, on the
    # worker probe_costs times a step on: sent as it is, Dask's serializer of a module would
    # name its class, which a worker without the user's file cannot import.
    ensure_plugin(client)
    first = sorted(worker_threads(client))[0]
    module = client.submit(unwrap, travelling(trainer._model(), factory=factory),
                           workers=[first], pure=False)
    try:
        model = probe_costs(client, cast(Any, module), xb, yb, **settings)
    finally:
        module.release()
    return model, time.perf_counter() - started


def probe_arguments(trainer: Any, *, n_rows: int) -> tuple[int, dict[str, Any]]:
    """``(rows, settings)`` of the probe: the rows of the batch it measures (one trainer's batch,
    at most the data's ``n_rows``) and the keyword arguments of
    :func:`~dask_train.engines.ps.probe.probe_costs` from the Trainer's settings.

    The batch is the one each trainer will run: :meth:`Trainer.per_trainer_batch`, so with
    ``global_batch_size`` it is that divided by ``workers``, not ``batch_size``.
    """
    # A prefetch the trainers choose as they run ("auto") starts from one push in flight.
    # Measured for the trainers asked for: strategy="auto" scales it to each candidate's batch.
    prefetch = trainer.prefetch if isinstance(trainer.prefetch, (int, bool)) else 1
    rows = min(int(n_rows), int(trainer.per_trainer_batch()))
    return rows, {"loss": trainer.loss, "optimizer": trainer.optimizer, "lr": float(trainer.lr),
                  "options": trainer.optimizer_options, "prefetch": int(prefetch),
                  "grad_accumulation": int(trainer.grad_accumulation),
                  "timeout": float(trainer.timeout)}
