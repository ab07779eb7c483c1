"""``resources={"GPU": 1}`` on a cluster of a GPU worker beside a CPU one, as a real mixed
cluster is: ``device="auto"`` is the GPU for the ranks (only the trainers' workers are asked),
and the scorer, placed on the CPU worker, computes on its CPU.

Needs CUDA (skipped without it, with the reason, as tests/gpu/test_cuda.py); the placement
itself is covered on CPU workers by tests/api/test_resources.py on every machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import dask
import pytest
import torch
from distributed import Client, LocalCluster, Nanny

import dask_train as dt
from dask_train.data._cluster import live_workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine (torch.cuda.is_available() "
                                       "is False); the GPU paths run where one is present")


@pytest.fixture(scope="module")
def mixed() -> Iterator[Client]:
    # Spawned: each worker reads its own CUDA_VISIBLE_DEVICES when it starts.
    with dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                         dashboard_address=":0", env={"CUDA_VISIBLE_DEVICES": ""}) as cluster:
        [(_, plain)] = cluster.new_worker_spec().items()
        options = {**plain["options"], "env": {"CUDA_VISIBLE_DEVICES": "0"},
                   "resources": {"GPU": 1}}
        cluster.worker_spec["gpu-0"] = {"cls": Nanny, "options": options}
        cluster.sync(cluster._correct_state)
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=120)
            yield client


def _device(ctx):
    return str(ctx.device)


def test_ranks_get_the_gpu_and_the_scorer_the_cpu_beside_them(mixed: Client) -> None:
    gpu = {a for a, w in live_workers(mixed).items() if w.get("resources", {}).get("GPU")}
    result = dt.run(_device, workers=None, resources={"GPU": 1}, client=mixed)
    assert result.returns == ["cuda:0"]
    X, y = dt.datasets.digits(4_000, seed=0, chunks=1_000)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    fit = dt.Trainer(net, strategy="sync", workers=1, resources={"GPU": 1}, epochs=1,
                     progress=False, client=mixed).fit(X, y, validation=dt.datasets.digits_test())
    assert set(fit.roles["trainer"]) == gpu and not set(fit.roles["scorer"]) & gpu
    assert fit.history["accuracy"].notna().any()
