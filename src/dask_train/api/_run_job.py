"""``dt.run`` on the cluster, once its arguments are checked: the data onto the workers, the
ranks placed, the one controller driving :class:`~dask_train.engines.run.engine.RunEngine`
generations, and the :class:`~dask_train.api._run.RunResult` built from its outcome."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from distributed import Client

from dask_train.api._data import training_blocks
from dask_train.api._result import phase_timings
from dask_train.api._run_result import RunResult
from dask_train.controller._controller import Controller, Outcome
from dask_train.data._blocks import BlockSet, as_dask_array, scatter_blocks
from dask_train.engines._spec import JobSpec
from dask_train.errors import InvalidInput
from dask_train.policy._data_mode import read_ahead
from dask_train.policy._failure import FailureConfig
from dask_train.policy._placement import Roles
from dask_train.policy.callbacks import run_callbacks
from dask_train.runtime._roles import ensure_plugin, worker_threads

logger = logging.getLogger(__name__)

#: The ledger's epoch bound when the function alone says how many epochs it trains.
_UNBOUNDED_EPOCHS = 1_000_000_000


def run_job(client: Client, s: Mapping[str, Any], *, fn_blob: bytes, small: dict[str, Any],
            clock: dict[str, float]) -> RunResult:
    """Run the checked ``dt.run`` settings ``s`` on ``client``'s cluster."""
    from dask_train.engines.run.context import RunSettings
    from dask_train.engines.run.engine import RunEngine
    from dask_train.runtime._devices import probe_devices

    ensure_plugin(client)
    least, most = _bounds(s["workers"], client)
    alive = _wait_for_workers(client, least, timeout=float(s["timeout"]))
    t = time.time()
    blocks, labels, train = _stream(client, s["data"], ranks=min(most, len(alive)),
                                    mode=s.get("data_mode", "auto"), timeout=float(s["timeout"]))
    clock["persist"] = time.time() - t
    devices = probe_devices(client, s["device"])
    spec = JobSpec(
        module=None, n_params=0, loss=None, optimizer="", lr=0.0, optimizer_options={},
        batch_size=int(s["batch_size"]), epochs=int(s["epochs"] or _UNBOUNDED_EPOCHS),
        shuffle=bool(s["shuffle"]), seed=int(s["seed"]), prefetch=0, grad_accumulation=1,
        blocks_ahead=read_ahead(s["blocks_ahead"])[0], blocks_ahead_max=read_ahead(s["blocks_ahead"])[1],
        score_every=0.0, timeout=float(s["timeout"]),
        stop=list(s["stop"] or ()), callbacks=list(s["callbacks"] or ()), progress=False,
        strategy="run", ps=0, workers=most, scorer=0, checkpoint=s["checkpoint"],
        failure=s["failure"] or FailureConfig(), on_nan="skip", device_kind=devices.kind,
        devices=dict(devices.by_worker))
    run = RunSettings(train=train, labels=labels, small=small,
                      checkpointing=s["checkpoint"] is not None, epochs=s["epochs"],
                      batch_size=int(s["batch_size"]), sharded_root=_staging(s["checkpoint"]))
    user_config = dict(s["config"] or {})

    def plan(alive: Mapping[str, int]) -> Roles:
        if len(alive) < least:
            raise InvalidInput([f"workers={s['workers']!r}: only {len(alive)} Dask workers are "
                                f"left, fewer than the {least} the job needs; add workers or "
                                "lower the least number of ranks."])
        # One rank per worker process (torch's default group is one per process), in address
        # order so that a restart on the same workers gives each the same rank.
        return Roles({"worker": sorted(alive)[:most], "ps": [], "scorer": []})

    def make_engine(roles: Roles, job: str, restore: Any) -> RunEngine:
        return RunEngine(client, spec, roles, blocks, job=job, restore=restore, fn_blob=fn_blob,
                         run=run, user_config=user_config)

    roles = plan(alive)
    settings = {k: s[k] for k in ("workers", "epochs", "batch_size", "seed", "stop", "resume")}
    run_callbacks(spec.callbacks, "on_fit_start", {
        "roles": roles, "rows": blocks.n_rows, "params": {**user_config, "run": settings}})
    started = time.time()
    controller = Controller(client, spec, make_engine=make_engine, plan_roles=plan, roles=roles,
                            rows=blocks.n_rows)
    try:
        outcome = controller.run_sync(resume=bool(s["resume"]))
    finally:
        blocks_release(blocks)
    result = _result(outcome, wall_s=time.time() - started, clock=clock)
    run_callbacks(spec.callbacks, "on_fit_end", result)
    return result


def _staging(config: Any) -> str:
    """Where the ranks write a sharded state before the controller moves it into a checkpoint:
    beside the checkpoints, so that the move is a rename on a local disk."""
    if config is None:
        return ""
    from dask_train.checkpoint import CheckpointStore
    from dask_train.checkpoint._io import StoragePath

    path = f"{CheckpointStore(config).path.rstrip('/')}/.staging"
    # The ranks open it with the checkpoint's storage options (credentials, an endpoint).
    return StoragePath(path, config.storage_options) if config.storage_options else path


def _bounds(workers: Any, client: Client) -> tuple[int, int]:
    """(least, most) ranks."""
    if workers is None:
        n = max(1, len(worker_threads(client)))
        return 1, n
    if isinstance(workers, tuple):
        return int(workers[0]), int(workers[1])
    return int(workers), int(workers)


def _wait_for_workers(client: Client, least: int, *, timeout: float) -> dict[str, int]:
    """The live workers, once there are at least ``least`` of them (up to ``timeout``)."""
    deadline = time.monotonic() + timeout
    alive = worker_threads(client)
    while len(alive) < least:
        if time.monotonic() > deadline:
            raise InvalidInput([f"workers={least} or more are needed but the cluster has "
                                f"{len(alive)} Dask workers after {timeout:g} s: add workers, or "
                                "ask for fewer ranks."])
        time.sleep(0.2)
        alive = worker_threads(client)
    return alive


def _stream(client: Client, data: Mapping[str, Any] | None, *, ranks: int, mode: str = "auto",
            timeout: float = 120.0) -> tuple[BlockSet, bool, str | None]:
    """The streamed data set's blocks, whether it has targets, and its name: persisted on the
    workers, or read from storage each epoch (``mode``, as ``Trainer.fit(data=...)``)."""
    if not data:
        return BlockSet([], []), False, None
    name, value = next(iter(data.items()))
    x, y = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
    labels = y is not None
    if not any(hasattr(a, "dask") or hasattr(a, "to_dask_array") for a in (x, y)) and \
            not isinstance(x, Mapping):
        # In memory: sent to the workers in blocks, never through the graph (as fit does).
        x_np = np.asarray(x)
        y_np = np.asarray(y) if labels else np.zeros(len(x_np), dtype=np.int8)
        return client.sync(scatter_blocks, client, x_np, y_np), labels, name
    X = as_dask_array(x, name=f"data[{name!r}] X")
    if labels:
        Y = as_dask_array(y, name=f"data[{name!r}] y")
    else:
        import dask.array as da

        Y = da.zeros((X.shape[0],), chunks=(X.chunks[0],), dtype=np.int8)
    X, Y = _enough_blocks(X, Y, ranks)
    blocks = training_blocks(client, X, Y, weights=None, local=None, mode=mode, labels=False,
                             timeout=timeout)
    return blocks, labels, name


def _enough_blocks(X: Any, Y: Any, ranks: int) -> tuple[Any, Any]:
    """Rows in at least four blocks per rank: a block is read by one rank per epoch, so with
    fewer blocks than ranks some ranks would get no share at all."""
    want = 4 * ranks
    if X.numblocks[0] >= 2 * ranks or X.shape[0] < want:
        return X, Y
    rows = -(-int(X.shape[0]) // want)
    logger.info("the streamed data has %d row blocks for %d ranks: rechunked to %d rows a block",
                X.numblocks[0], ranks, rows)
    return X.rechunk({0: rows}), Y.rechunk({0: rows})


def blocks_release(blocks: BlockSet) -> None:
    """Free the workers' copies of the streamed blocks."""
    for fut in blocks.futures:
        fut.release()


def _result(outcome: Outcome, *, wall_s: float, clock: Mapping[str, float]) -> RunResult:
    from dask_train.report import history_frame, ledger_frame

    log, ending = outcome.log, outcome.ending
    ranks = sorted(ending.trainers, key=lambda r: r["trainer"])
    return RunResult(
        returns=[r.pop("returned", None) for r in ranks], history=history_frame(log.records),
        stopped_by=outcome.stopped_by, steps=ending.steps, samples=ending.samples,
        epochs_completed=outcome.epochs_completed, wall_s=wall_s,
        ledger=ledger_frame(outcome.ledger), roles=outcome.roles, ranks=ranks,
        failures=list(log.failures), checkpoints=list(log.checkpoints),
        generations=log.generations, timings=phase_timings(clock, log),
        started_at=log.started)
