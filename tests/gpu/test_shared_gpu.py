"""Two ranks on one GPU: more Dask workers than GPUs on a host share them, over gloo.

NCCL refuses two ranks on one device, so the sync Trainer and ``dt.run`` take gloo when the
job's workers share a GPU; gloo all-reduces CUDA tensors through host memory. Each job is also
run on the CPU, on the same workers, and the GPU run must reach that run's accuracy. Skipped
without CUDA, with the reason: these paths run where a GPU is present (``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from distributed import Client, LocalCluster

import dask_train as dt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine (torch.cuda.is_available() "
                                       "is False); the GPU paths run where one is present")


@pytest.fixture(scope="module")
def shared_client() -> Iterator[Client]:
    # Two workers per GPU: every GPU is shared by two ranks.
    n = 2 * max(1, torch.cuda.device_count())
    with LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _fit(client: Client, device: str) -> float:
    X, y = dt.datasets.digits(24_000, seed=0, chunks=3_000)
    workers = len(client.scheduler_info()["workers"])
    result = dt.Trainer(_net(), strategy="sync", workers=workers, lr=3e-3, batch_size=128,
                        epochs=2, device=device, progress=False,
                        client=client).fit(X, y, validation=dt.datasets.digits_test())
    assert result.stopped_by == "epochs=2"
    assert all(t["queued_updates"] == (device == "cuda") for t in result.trainers)
    return float(result.history["accuracy"].iloc[-1])


def test_the_sync_trainer_shares_a_gpu_between_two_ranks(shared_client: Client) -> None:
    on_cpu = _fit(shared_client, "cpu")
    on_gpu = _fit(shared_client, "cuda")
    assert on_gpu >= on_cpu - 0.02, (on_gpu, on_cpu)


def _train(ctx: Any) -> tuple[str, str]:
    model = ctx.prepare(_net())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    xv, yv = ctx.dataset("val")
    for _ in ctx.epochs(2):
        for xb, yb in ctx.batches(batch_size=128):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        with torch.no_grad():
            model.eval()
            accuracy = (model(xv).argmax(1) == yv).float().mean().item()
            model.train()
        ctx.report({"accuracy": accuracy})
    return str(ctx.device), torch.distributed.get_backend()


def _run(client: Client, device: str) -> Any:
    X, y = dt.datasets.digits(24_000, seed=0, chunks=3_000)
    workers = len(client.scheduler_info()["workers"])
    return dt.run(_train, workers=workers, client=client, device=device,
                  data={"train": (X, y), "val": dt.datasets.digits_test()})


def test_dt_run_shares_a_gpu_between_two_ranks_over_gloo(shared_client: Client) -> None:
    on_cpu = _run(shared_client, "cpu")
    on_gpu = _run(shared_client, "cuda")
    assert {device.split(":")[0] for device, _ in on_gpu.returns} == {"cuda"}
    assert {backend for _, backend in on_gpu.returns} == {"gloo"}
    accuracy = (float(on_gpu.history["accuracy"].iloc[-1]),
                float(on_cpu.history["accuracy"].iloc[-1]))
    assert accuracy[0] >= accuracy[1] - 0.02, accuracy
