"""The model on the cluster: a small one travels inside a task (Dask recomputes it when its
holder dies), a large one is scattered, and sent again when its only holder was lost. A real
cluster, a real SIGKILL."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch
from distributed import Client, LocalCluster

from dask_train.data._cluster import live_workers
from dask_train.engines.roles.sending import EMBED_MODULE_BYTES, is_lost, send_module
from dask_train.models._transport import travelling


@pytest.fixture(scope="module")
def cluster_client() -> Iterator[Client]:
    # Its own cluster: these tests kill its workers. One for the module (one per test cost a
    # start and a close more).
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


@pytest.fixture()
def own_client(cluster_client: Client) -> Client:
    cluster_client.wait_for_workers(2, timeout=60)  # the last test's victim is back
    return cluster_client


def _kill_holder(client: Client, key: str) -> str:
    [holder] = client.who_has()[key]
    os.kill(client.run(os.getpid, workers=[holder])[holder], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while holder in live_workers(client) and time.monotonic() < deadline:
        time.sleep(0.1)
    return holder


def test_a_large_model_lost_with_its_holder_is_sent_again(own_client: Client) -> None:
    net = torch.nn.Linear(3_000, 3_000)  # 36 MB: over the size that travels inside a task
    payload = travelling(net)
    assert payload.nbytes > EMBED_MODULE_BYTES
    future = own_client.sync(send_module, own_client, payload, "job")
    assert not is_lost(future)
    _kill_holder(own_client, str(future.key))
    deadline = time.monotonic() + 10
    while not is_lost(future) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert is_lost(future), future.status
    again = own_client.sync(send_module, own_client, payload, "job")
    copy = own_client.submit(lambda p: p.module().weight.shape, again).result(timeout=30)
    assert tuple(copy) == (3_000, 3_000)


def test_a_small_model_is_computed_again_after_its_holder_dies(own_client: Client) -> None:
    payload = travelling(torch.nn.Linear(8, 3))
    future = own_client.sync(send_module, own_client, payload, "job")
    future.result(timeout=30)
    _kill_holder(own_client, str(future.key))
    own_client.wait_for_workers(1)
    time.sleep(0.5)
    assert not is_lost(future)  # a graph key: recomputed, never lost
    shape = own_client.submit(lambda p: p.module().weight.shape, future).result(timeout=30)
    assert tuple(shape) == (3, 8)
