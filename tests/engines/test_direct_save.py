"""A leaving worker's own write in a hand-over (a direct call, out of the scheduler's reach) runs
off its event loop: Dask runs a direct call's plain function on the loop, and a write there held
up the worker's connections, heartbeats and the hold of its own hand-over while it sent."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from distributed import Client

from dask_train.checkpoint._state import load_state
from dask_train.data._cluster import live_workers
from dask_train.engines.harness import control as worker_side
from dask_train.engines.run.context import StateHolder
from dask_train.runtime._calls import run_direct
from dask_train.runtime._plugin import worker_state


class _ThreadNoting(StateHolder):
    """dt.run's holder of a reported state, noting the thread its write ran in."""

    def save(self, path: str, *, metadata: Any) -> dict[str, Any]:
        record = super().save(path, metadata=metadata)
        return {**record, "thread": threading.get_ident()}


def _hold(job: str, dask_worker: Any = None) -> int:
    state = {"w": torch.arange(6, dtype=torch.float32), "epoch": 3}
    worker_state(dask_worker).job(job).params[0] = _ThreadNoting(state, steps=7, next_epoch=4)
    return threading.get_ident()  # client.run calls a plain function on the worker's loop


def _drop(job: str, dask_worker: Any = None) -> None:
    worker_state(dask_worker).drop(job)


def test_a_direct_save_writes_off_the_workers_event_loop(client: Client, tmp_path: Path) -> None:
    address = sorted(live_workers(client))[0]
    job = "direct-save-test"
    loop_thread = client.run(_hold, job, workers=[address])[address]
    path = str(tmp_path / "shard-0.safetensors")
    try:
        record = client.sync(run_direct, client, worker_side.save_shard_direct, job=job, index=0,
                             path=path, metadata={"step": "7"}, address=address)
    finally:
        client.run(_drop, job, workers=[address])
    assert record["version"] == 7 and record["thread"] != loop_thread
    state = load_state(path)
    assert torch.equal(state["w"], torch.arange(6, dtype=torch.float32)) and state["epoch"] == 3
