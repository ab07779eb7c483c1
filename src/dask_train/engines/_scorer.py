"""The scorer every torch engine shares: evaluates the latest parameters every ``score_every``
seconds and publishes the score as an event (``worker.log_event``: 5,000 events in 0.12 s here,
never a Queue). It reads the parameters the way a trainer does: from the parameter servers
(async-ps) or from sync rank 0, which publishes its parameters under the same index.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from distributed import get_worker, secede

from dask_train.engines._ps_client import PSClient, ShardRef, write_params
from dask_train.engines._worker import model_for
from dask_train.models._buffers import BufferSet
from dask_train.runtime._plugin import worker_state


def run_scorer(
    module: Any,
    validation: tuple[np.ndarray, np.ndarray],
    *,
    job: str,
    shards: Sequence[ShardRef],
    config: Mapping[str, Any],
) -> dict[str, Any]:
    """Dask task: every ``score_every`` seconds evaluate the latest parameters and publish the score.

    Scores go out with ``worker.log_event`` (5,000 events in 0.12 s here), never through a Queue.
    The last few scored parameter snapshots are kept: when a score stopped the job, the model that
    earned it is returned (``{"record", "params", "buffers"}``), not the one a few asynchronous
    steps later. Otherwise it scores the final parameters once more and returns that record alone.
    The model is evaluated with the buffers pulled with the parameters (BatchNorm statistics).
    """
    worker = get_worker()
    worker_state(worker).configure_torch()
    state = worker_state(worker).job(job)
    secede()
    ps = PSClient(worker, job, state, shards, timeout=config["timeout"])
    model = model_for(module, worker.address, config)
    buffers = model.buffers()
    x_val, y_val = validation
    snapshots: dict[int, tuple[dict[str, Any], np.ndarray, np.ndarray | None]] = {}
    # A fixed rate, not a fixed pause: a score every score_every seconds, or back to back when
    # one evaluation takes longer (a large model), never score_every plus the evaluation time.
    due = time.monotonic() + config["score_every"]
    while not state.scorer_stop.wait(max(0.0, due - time.monotonic())):
        due = max(due + config["score_every"], time.monotonic())
        try:
            record = _score(ps, model, buffers, x_val, y_val, loss=config["loss"],
                            metrics=config.get("metrics"))
        except KeyError:
            # The parameters are not published yet (a sync job's rank 0 is still starting);
            # a worker that vanished instead is the controller's to report.
            continue
        if record["step"] not in snapshots:
            snapshots[record["step"]] = (record, model.read_params(), buffers.gather())
            for old in sorted(snapshots)[:-_SNAPSHOTS]:
                del snapshots[old]
            worker.log_event(config["topic"], {"kind": "score", **record})
    if state.scorer_keep in snapshots:
        record, params, kept = snapshots[state.scorer_keep]
        return {"record": record, "params": params, "buffers": kept}
    record = _score(ps, model, buffers, x_val, y_val, loss=config["loss"],
                    metrics=config.get("metrics"))
    return {"record": record, "params": None, "buffers": None}


# Scores reach the controller within milliseconds, so the one that stops a job is among the last.
_SNAPSHOTS = 4


def _score(
    ps: PSClient, model: Any, buffers: BufferSet, x: np.ndarray, y: np.ndarray, *,
    loss: Any, metrics: Any = None,
) -> dict[str, Any]:
    exchange = ps.pull()
    write_params(model, exchange)
    buffers.scatter(exchange.buffers)
    scores = model.evaluate(x, y, loss=loss, metrics=metrics)
    bad = {k: v for k, v in scores.items() if not math.isfinite(v)}
    return {
        "step": exchange.version,
        "samples": exchange.samples,
        "wall": time.time(),
        "nonfinite": sorted(bad),
        **scores,
    }
