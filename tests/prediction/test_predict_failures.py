"""dt.predict when a worker holding predicted blocks is SIGKILLed mid-prediction (its own cluster)."""

from __future__ import annotations

import os
import signal
import time

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster, wait

import dask_train as dt


def _slow_predict(params: np.ndarray, X: np.ndarray) -> np.ndarray:
    time.sleep(0.05)  # long enough for the kill to land while blocks are still being predicted
    return X @ params


def _loss_grad(params: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    r = X @ params - y
    return float(r @ r), X.T @ r


@pytest.mark.timeout(180)
def test_a_worker_lost_mid_prediction_costs_only_its_blocks() -> None:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        rng = np.random.default_rng(0)
        Xn = rng.normal(size=(3_000, 4))
        X = da.from_array(Xn, chunks=(100, 4)).persist()
        model = dt.ArrayModel(params=np.array([1.0, -2.0, 0.5, 3.0]), loss_grad=_loss_grad,
                              predict=_slow_predict)
        p = dt.predict(model, X).persist()
        futures = client.futures_of(p)
        while sum(f.status == "finished" for f in futures) < 6:  # under way on both workers
            time.sleep(0.02)
        done = [f for f in futures if f.status == "finished"]
        victim = sorted(client.who_has(done[0])[done[0].key])[0]
        [pid] = client.run(os.getpid, workers=[victim]).values()
        os.kill(pid, signal.SIGKILL)
        wait(futures, timeout=120)
        np.testing.assert_allclose(p.compute(), Xn @ model.params)
        assert p.chunks[0] == X.chunks[0]
        assert victim not in client.scheduler_info(n_workers=-1)["workers"]
        assert sum(f.status == "finished" for f in futures) == len(futures)
