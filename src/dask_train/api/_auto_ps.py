"""``ps="auto"``: the number of parameter servers, chosen by the cost model at fit time.

Before the roles are placed, the job's per-step costs are measured on the cluster (a few
gradients of the module on one batch, an optimizer step, an echo between two workers: see
``engines.ps.probe``); the cost model (``policy._cost``) predicts the throughput of each server
count from 1 to the number of Dask workers, and the fewest servers within 10% of the best are
taken. The choice, its predicted rate and what limits it are logged at INFO.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from distributed import Client

logger = logging.getLogger("dask_train.api")

AUTO = "auto"


def resolve_ps(trainer: Any, client: Client, X: Any, y: Any) -> int:
    """The server count for this fit: ``trainer.ps`` itself unless it is ``"auto"``.

    ``X`` and ``y`` are the training dask arrays (one batch of them is computed for the probe).
    A sync job has no servers, so ``"auto"`` costs nothing there.
    """
    if trainer.ps != AUTO:
        return int(trainer.ps)
    if trainer.strategy == "sync":
        return 0
    from dask_train.engines.ps.probe import probe_costs
    from dask_train.runtime._roles import worker_threads

    n, settings = probe_arguments(trainer, n_rows=int(X.shape[0]))
    xb, yb = (np.asarray(a) for a in client.compute([X[:n], y[:n]], sync=True))
    model = probe_costs(client, trainer._model(), xb, yb, **settings)
    workers = int(trainer.workers)
    choice = model.recommend_ps(workers=workers, max_ps=max(1, len(worker_threads(client))))
    logger.info("ps='auto': %s (compute %.1f ms a step, link %.0f MB/s, %d parameters)",
                choice.describe(), model.compute_s * 1e3, model.link_bytes_per_s / 1e6,
                model.n_params)
    return choice.ps


def probe_arguments(trainer: Any, *, n_rows: int) -> tuple[int, dict[str, Any]]:
    """``(rows, settings)`` of the probe: the rows of the batch it measures (one trainer's batch,
    at most the data's ``n_rows``) and the keyword arguments of
    :func:`~dask_train.engines.ps.probe.probe_costs` from the Trainer's settings.

    The batch is the one each trainer will run: :meth:`Trainer.per_trainer_batch`, so with
    ``global_batch_size`` it is that divided by ``workers``, not ``batch_size``.
    """
    # A prefetch the trainers choose as they run ("auto") starts from one push in flight.
    prefetch = trainer.prefetch if isinstance(trainer.prefetch, (int, bool)) else 1
    rows = min(int(n_rows), int(trainer.per_trainer_batch()))
    return rows, {"loss": trainer.loss, "optimizer": trainer.optimizer, "lr": float(trainer.lr),
                  "options": trainer.optimizer_options, "prefetch": int(prefetch),
                  "grad_accumulation": int(trainer.grad_accumulation),
                  "timeout": float(trainer.timeout)}
