"""``strategy="auto"`` on one machine: each candidate's whole step, measured there.

Where every Dask worker is on one machine and the shards can live in host memory, the
candidates' rates are measured rather than predicted (``engines.shared.step_probe``): one
process alone, async-ps trainers on one shared shard, sync ranks summing through host memory,
each for ``duration_s`` with every process started together. The samples per second that come
back replace the cost model's predictions for those candidates (``policy._strategy``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from distributed import Client

logger = logging.getLogger("dask_train.api")

#: Seconds each candidate runs: enough for a few hundred steps of a small model, and for a
#: large one a few steps (each candidate's rate is its steps over the time they took).
DURATION_S = 0.08


def candidate_shapes(trainer: Any, n_workers: int) -> dict[str, tuple[int, int]]:
    """``{candidate: (rows of one step, processes)}`` for the candidates that can be measured:
    one process; sync with a rank per worker up to ``trainer.workers`` (from two); async-ps
    when each trainer has a worker of its own (several in one process share its interpreter,
    which this measurement does not run). The rows are as ``choose_strategy`` counts them."""
    global_batch = trainer.global_batch_size

    def rows(w: int) -> int:
        return int(trainer.batch_size) if global_batch is None else max(1, int(global_batch) // w)

    shapes = {"one-process": (rows(1), 1)}
    ranks = min(int(trainer.workers), n_workers)
    if ranks >= 2:
        shapes["sync"] = (rows(ranks), ranks)
    if 2 <= int(trainer.workers) <= n_workers:
        shapes["async-ps"] = (rows(int(trainer.workers)), int(trainer.workers))
    return shapes


def measure_candidates(trainer: Any, client: Client, X: Any, y: Any, *,
                       workers: list[str]) -> dict[str, float]:
    """Samples per second of each candidate of :func:`candidate_shapes`, measured on
    ``workers`` (all on one machine). Empty where a measurement cannot be made here (gradient
    accumulation, which these steps do not run; an optimizer whose state cannot live in host
    memory runs async-ps without it, so async-ps is left to the model)."""
    from dask_train.api._auto_ps import shipped_modules
    from dask_train.engines.shared.shard import shareable
    from dask_train.engines.shared.step_probe import candidate_rate_task, segment_path

    if int(trainer.grad_accumulation) != 1 or not isinstance(trainer.optimizer, str):
        return {}
    options = dict(trainer.optimizer_options or {})
    shapes = candidate_shapes(trainer, len(workers))
    if not shareable(trainer.optimizer, float(trainer.lr), options):
        shapes.pop("async-ps", None)
    most = max(rows for rows, _ in shapes.values())
    xs, ys = (np.asarray(a) for a in client.compute([X[:most], y[:most]], sync=True))
    modules = shipped_modules(trainer, client, workers)
    timeout = float(trainer.timeout)
    measured: dict[str, float] = {}
    try:
        for name, (rows, world) in shapes.items():
            mode = {"one-process": "one", "sync": "sync", "async-ps": "async"}[name]
            path, start = segment_path(), time.time() + 0.05 + 0.02 * world
            futures = [client.submit(
                candidate_rate_task, modules[workers[r]], xs[:rows], ys[:rows], mode=mode,
                loss=trainer.loss, optimizer=trainer.optimizer, lr=float(trainer.lr),
                options=options, rank=r, world=world, path=path, start_at=start,
                duration_s=DURATION_S, timeout=timeout, workers=[workers[r]], pure=False)
                for r in range(world)]
            try:
                rates = [float(f.result(timeout)) for f in futures]
            except (OSError, TimeoutError, ConnectionError, RuntimeError) as exc:
                # No room in /dev/shm, a worker too slow to start: the model predicts instead.
                logger.info("strategy='auto': %s could not be measured here (%s); predicted "
                            "instead", name, exc)
                continue
            # Sync's ranks step together (one rate); async-ps's trainers each at their own.
            steps = min(rates) if mode == "sync" else sum(rates)
            measured[name] = steps * rows * (world if mode == "sync" else 1)
    finally:
        for future in modules.values():
            future.release()
    return measured
