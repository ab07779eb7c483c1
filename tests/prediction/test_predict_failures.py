"""dt.predict when a worker holding predicted blocks is SIGKILLed mid-prediction (a cluster of
its own): the result equals the undisturbed one, for a numpy ArrayModel and a torch module."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster, wait

import dask_train as dt
from dask_train.data._cluster import live_workers


@pytest.fixture(scope="module")
def client2() -> Iterator[Client]:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


def _slow_predict(params: np.ndarray, X: np.ndarray) -> np.ndarray:
    time.sleep(0.05)  # long enough for the kill to land while blocks are still being predicted
    return X @ params


def _loss_grad(params: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    r = X @ params - y
    return float(r @ r), X.T @ r


class SlowNet(torch.nn.Module):
    """An MLP whose forward takes a while (time for the kill to land mid-prediction)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                        torch.nn.Linear(32, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return self.body(x)


def _kill_mid_prediction(client: Client, p: da.Array) -> np.ndarray:
    """Start ``p``, SIGKILL a worker once it holds finished blocks (while others are still to
    run); ``p`` computed after that."""
    futures = client.futures_of(p)
    while sum(f.status == "finished" for f in futures) < 6:  # under way on both workers
        time.sleep(0.02)
    done = [f for f in futures if f.status == "finished"]
    victim = sorted(client.who_has(done[0])[done[0].key])[0]
    [pid] = client.run(os.getpid, workers=[victim]).values()
    os.kill(pid, signal.SIGKILL)
    wait(futures, timeout=120)
    got = p.compute()
    assert sum(f.status == "finished" for f in futures) == len(futures)
    assert victim not in live_workers(client)
    return np.asarray(got)


@pytest.fixture(autouse=True)
def _whole_cluster(client2: Client) -> None:
    # Before each test, not after: the last test's victim need not come back to be closed.
    client2.wait_for_workers(2, timeout=60)  # the nanny brings the last victim back


@pytest.mark.timeout(180)
def test_a_worker_lost_mid_prediction_costs_only_its_blocks(client2: Client) -> None:
    rng = np.random.default_rng(0)
    Xn = rng.normal(size=(3_000, 4))
    X = da.from_array(Xn, chunks=(100, 4)).persist()
    model = dt.ArrayModel(params=np.array([1.0, -2.0, 0.5, 3.0]), loss_grad=_loss_grad,
                          predict=_slow_predict)
    p = dt.predict(model, X).persist()
    np.testing.assert_allclose(_kill_mid_prediction(client2, p), Xn @ model.params)
    assert p.chunks[0] == X.chunks[0]


@pytest.mark.timeout(180)
def test_a_torch_prediction_survives_a_killed_worker_unchanged(client2: Client) -> None:
    net = SlowNet()
    rng = np.random.default_rng(1)
    Xn = rng.normal(size=(3_000, 8)).astype(np.float32)
    X = da.from_array(Xn, chunks=(100, 8)).persist()  # 30 blocks, spread over both workers
    undisturbed = dt.predict(net, X).compute()
    # The model's bytes are a graph key, not scattered data: the blocks the dead worker held,
    # and those it had not predicted yet, are computed again elsewhere from the same bytes.
    got = _kill_mid_prediction(client2, dt.predict(net, X).persist())
    np.testing.assert_array_equal(got, undisturbed)
    with torch.no_grad():
        np.testing.assert_allclose(got, net(torch.from_numpy(Xn)).numpy(), rtol=1e-5, atol=1e-6)

