"""``strategy="auto"`` on one machine: each candidate's whole step, measured there.

Where every Dask worker is on one machine and the shards can live in host memory, the
candidates' rates are measured rather than predicted (``engines.measure.step``): one
process alone, async-ps trainers on one shared shard, sync ranks summing through host memory,
each for ``duration_s`` with every process started together. The samples per second that come
back replace the cost model's predictions for those candidates (``policy._strategy``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from distributed import Client

if TYPE_CHECKING:
    from dask_train.api._plan import FitPlan

logger = logging.getLogger("dask_train.api")

#: Seconds each candidate runs: enough for a few hundred steps of a small model, and for a
#: large one a few steps (each candidate's rate is its steps over the time they took).
DURATION_S = 0.08


def candidate_shapes(plan: FitPlan, n_workers: int) -> dict[str, tuple[int, int]]:
    """``{candidate: (rows of one step, processes)}``, every candidate ``choose_strategy``
    weighs: one process; sync with a rank per worker up to the ``workers`` asked for (from
    two); async-ps with that many trainers. Empty when async-ps has more trainers than
    workers (several in one process share its interpreter, which this measurement does not
    run): the candidates are then all predicted, never some measured and some predicted. The
    rows are as ``choose_strategy`` counts them."""
    # strategy="auto" takes a count of workers only: its bounds are (count, count).
    data, workers = plan.settings.data, plan.settings.cluster.bounds(n_workers)[1]
    rows = data.per_trainer_batch  # the one rule: batch_size, or the global batch split

    if workers > n_workers:
        return {}
    shapes = {"one-process": (rows(1), 1)}
    if workers >= 2:
        shapes["sync"] = (rows(workers), workers)
    shapes["async-ps"] = (rows(workers), workers)
    return shapes


def measure_candidates(plan: FitPlan, client: Client, X: Any, y: Any, *,
                       workers: list[str]) -> dict[str, float]:
    """Samples per second of each candidate of :func:`candidate_shapes`, measured on
    ``workers`` (all on one machine); empty, and every candidate predicted, where one of them
    cannot be measured here: gradient accumulation (these steps do not run it), an optimizer
    whose state cannot live in host memory (its async-ps runs without it), a measurement that
    failed (no room in ``/dev/shm``)."""
    from dask_train.api._auto_ps import shipped_modules
    from dask_train.engines.holders.shard import shareable
    from dask_train.engines.measure.step import candidate_rate_task, segment_path

    m = plan.settings.model
    if int(m.grad_accumulation) != 1 or not isinstance(m.optimizer, str):
        return {}
    optim = m.optim()
    shapes = candidate_shapes(plan, len(workers))
    if not shapes or not shareable(optim):
        return {}
    most = max(rows for rows, _ in shapes.values())
    xs, ys = (np.asarray(a) for a in client.compute([X[:most], y[:most]], sync=True))
    modules = shipped_modules(plan, client, workers)
    timeout = float(plan.settings.cluster.timeout)
    measured: dict[str, float] = {}
    try:
        for name, (rows, world) in shapes.items():
            mode = {"one-process": "one", "sync": "sync", "async-ps": "async"}[name]
            path, start = segment_path(), time.time() + 0.05 + 0.02 * world
            futures = [client.submit(
                candidate_rate_task, modules[workers[r]], xs[:rows], ys[:rows], mode=mode,
                loss=m.loss, optim=optim, rank=r, world=world, path=path, start_at=start,
                duration_s=DURATION_S, timeout=timeout, workers=[workers[r]], pure=False)
                for r in range(world)]
            try:
                rates = [float(f.result(timeout)) for f in futures]
            except (OSError, TimeoutError, ConnectionError, RuntimeError) as exc:
                # No room in /dev/shm, a worker too slow to start: the model predicts instead.
                logger.info("strategy='auto': %s could not be measured here (%s); every "
                            "candidate predicted instead", name, exc)
                return {}
            # Sync's ranks step together (one rate); async-ps's trainers each at their own.
            steps = min(rates) if mode == "sync" else sum(rates)
            measured[name] = steps * rows * (world if mode == "sync" else 1)
    finally:
        for future in modules.values():
            future.release()
    return measured
