"""A worker killed mid-training ends the job with a typed error naming it, in bounded time."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import dask.array as da
import numpy as np
import pytest
from _models import mlp
from distributed import Client, LocalCluster

import dask_train as dt


@pytest.fixture()
def own_client() -> Iterator[Client]:
    # A cluster of its own: this test kills one of its workers.
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            yield client


class _FirstScore(dt.Callback):
    def __init__(self) -> None:
        self.seen = threading.Event()

    def on_score(self, record):
        self.seen.set()
        return None


@pytest.mark.parametrize("victim_kind", ["worker", "ps"])
def test_sigkilled_worker_raises_a_typed_error(own_client: Client, victim_kind: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40_000, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=40_000)
    X, Y = da.from_array(x, chunks=(4000, 8)), da.from_array(y, chunks=4000)
    first = _FirstScore()
    trainer = dt.Trainer(
        mlp(8, 16, 3),
        lr=1e-3,
        ps=1,
        workers=2,
        batch_size=8,
        epochs=1000,
        score_every=0.2,
        callbacks=[first],
        timeout=30,
        progress=False,
        client=own_client,
    )
    roles = dt.start_roles(own_client, ps=1, worker=2, scorer=1)
    # worker: trainer 1's worker (with the scorer); ps: the server's worker (with trainer 0).
    victim = roles["worker"][1] if victim_kind == "worker" else roles["ps"][0]
    pid = own_client.run(os.getpid, workers=[victim])[victim]

    def kill() -> None:
        if first.seen.wait(60):
            os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    started = time.monotonic()
    with pytest.raises(dt.WorkerLost) as info:
        trainer.fit(X, Y, validation=(x[:200], y[:200]))
    elapsed = time.monotonic() - started
    killer.join(5)
    assert info.value.worker == victim
    assert victim in str(info.value)
    if victim_kind == "ps":
        assert isinstance(info.value, dt.ParameterServerLost)
        assert info.value.role == "ps-0"
    else:
        assert not isinstance(info.value, dt.ParameterServerLost)
        assert info.value.role in ("worker-1", "scorer-0")
    assert elapsed < 90  # bounded: the liveness check runs every second; no hang
