"""Training on GPUs: the same code with ``device="cuda"`` (one GPU per Dask worker).

These tests need CUDA in this process and in the workers. Without a GPU they are skipped, with the
reason: the CPU paths of the device code (``device="cpu"``/``"auto"``, autocast on the CPU) are
covered by tests/api/test_real_models.py on every machine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster

import dask_train as dt
from dask_train.data._cluster import live_workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine (torch.cuda.is_available() "
                                       "is False); the GPU paths run where one is present")


@pytest.fixture(scope="module")
def gpu_client() -> Iterator[Client]:
    # One worker per GPU, as dask-cuda's LocalCUDACluster would start; at least one.
    n = max(1, min(2, torch.cuda.device_count()))
    with LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
@pytest.mark.parametrize("precision", [False, True])
def test_cuda_training_reaches_the_target(gpu_client: Client, strategy: str,
                                          precision: bool) -> None:
    X, y = dt.datasets.digits(40_000, seed=0, chunks=5_000)
    workers = len(live_workers(gpu_client))
    result = dt.Trainer(_mlp(), strategy=strategy, workers=workers, lr=3e-3, batch_size=128,
                        epochs=3, device="cuda", mixed_precision=precision, score_every=0.5,
                        stop=[dt.StopAtScore("accuracy", 0.95)], progress=False,
                        client=gpu_client).fit(X, y, validation=dt.datasets.digits_test())
    assert result.stopped_by == "StopAtScore(accuracy>=0.95)"
    # The returned model is an ordinary CPU module, like every other result.
    assert all(p.device.type == "cpu" for p in result.model.parameters())


def test_auto_picks_the_gpu(gpu_client: Client) -> None:
    from dask_train.runtime._devices import probe_devices

    devices = probe_devices(gpu_client, "auto")
    assert devices.kind == "cuda" and all(d.startswith("cuda:") for d in devices.by_worker.values())


def test_auto_is_sync_on_gpu_workers_and_says_why(gpu_client: Client,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    X, y = dt.datasets.digits(8_000, seed=0, chunks=2_000)
    with caplog.at_level(logging.INFO, logger="dask_train.api"):
        result = dt.Trainer(_mlp(), strategy="auto", device="cuda", epochs=1, batch_size=128,
                            progress=False, client=gpu_client).fit(X, y)
    assert result.plan["strategy"] == "sync" and result.plan["ps"] == 0
    assert "async-ps's servers keep the parameters and optimizer state in host memory" in \
        caplog.text


class _LSTMNet(torch.nn.Module):
    """cuDNN's LSTM keeps its weights in one buffer of its own; the engines' flat parameter
    views must still reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(8, 48, batch_first=True)
        self.head = torch.nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x.reshape(-1, 8, 8))
        return self.head(out[:, -1])


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.b.weight = self.a.weight
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
@pytest.mark.parametrize("make", [_LSTMNet, _Tied], ids=["lstm", "tied"])
def test_cuda_trains_an_lstm_and_a_tied_net(gpu_client: Client, strategy: str, make: type) -> None:
    X, y = dt.datasets.digits(40_000, seed=0, chunks=5_000)
    workers = len(live_workers(gpu_client))
    torch.manual_seed(0)
    result = dt.Trainer(make(), strategy=strategy, workers=workers, lr=3e-3, batch_size=128,
                        epochs=3, device="cuda", score_every=0.5,
                        stop=[dt.StopAtScore("accuracy", 0.9)], progress=False,
                        client=gpu_client).fit(X, y, validation=dt.datasets.digits_test())
    assert result.stopped_by == "StopAtScore(accuracy>=0.9)"
    if make is _Tied:
        assert result.model.a.weight is result.model.b.weight


def _run_on_gpu(ctx, epochs: int = 3, device: str = "cuda"):
    model = ctx.prepare(_mlp())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    xv, yv = ctx.dataset("val")
    for _ in ctx.epochs(epochs):
        for xb, yb in ctx.batches(batch_size=128):
            assert xb.device.type == device and yb.device.type == device
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        with torch.no_grad():
            model.eval()
            accuracy = (model(xv).argmax(1) == yv).float().mean().item()
            model.train()
        # One GPU, one rank: prepare returns the model unwrapped (no DDP of one).
        own = getattr(model, "module", model)
        ctx.report({"accuracy": accuracy}, checkpoint={"model": own.state_dict()})
        if ctx.should_stop():
            break
    return str(ctx.device), torch.distributed.get_backend()


def test_dt_run_on_gpus_uses_nccl(gpu_client: Client, tmp_path) -> None:
    X, y = dt.datasets.digits(40_000, seed=0, chunks=5_000)
    workers = len(live_workers(gpu_client))
    result = dt.run(_run_on_gpu, workers=workers, client=gpu_client,
                    data={"train": (X, y), "val": dt.datasets.digits_test()},
                    stop=[dt.StopAtScore("accuracy", 0.9)],
                    checkpoint=dt.CheckpointConfig(tmp_path))
    assert all(device.startswith("cuda") for device, _ in result.returns)
    assert {backend for _, backend in result.returns} == {"nccl"}
    assert result.history["accuracy"].max() >= 0.9
    # The checkpoint loads on any machine: its tensors were written from the host.
    assert result.load_checkpoint()["model"]["0.weight"].device.type == "cpu"


def test_a_nonfinite_batch_on_the_gpu_is_left_out_as_on_the_cpu(gpu_client: Client) -> None:
    # On a GPU the loss is checked after the step's sums arrive (no wait for the device per
    # batch); a step with a non-finite loss is done again from the same batches, checked on the
    # host. The result must be the CPU's: the same steps, the same batch left out.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3_000, 64)).astype(np.float32)
    y = (x[:, :10].argmax(axis=1)).astype(np.int64)
    x[1_234] = np.nan
    X, Y = da.from_array(x, chunks=(1_000, 64)), da.from_array(y, chunks=1_000)
    results = {device: dt.Trainer(
        _net(), strategy="sync", optimizer="sgd", lr=0.05, workers=1, scorer=0, batch_size=100,
        epochs=2, seed=3, on_nan="skip", device=device, progress=False, client=gpu_client,
    ).fit(X, Y) for device in ("cpu", "cuda")}
    cpu, gpu = results["cpu"], results["cuda"]
    assert [t["queued_updates"] for t in gpu.trainers] == [True]  # the GPU's own path
    assert gpu.steps == cpu.steps == 2 * 30 - 2
    assert len(gpu.nonfinite) == len(cpu.nonfinite) == 2
    flat = {d: torch.cat([p.detach().reshape(-1).cpu() for p in r.model.parameters()])
            for d, r in results.items()}
    torch.testing.assert_close(flat["cuda"], flat["cpu"], rtol=1e-3, atol=1e-4)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


# -- two ranks on one GPU: more Dask workers than GPUs on a host share them, over gloo --------
# NCCL refuses two ranks on one device, so the sync Trainer and dt.run take gloo when the job's
# workers share a GPU; gloo all-reduces CUDA tensors through host memory. Each job also runs on
# the CPU, on the same workers, and the GPU run must reach that run's accuracy.
@pytest.fixture(scope="module")
def shared_client() -> Iterator[Client]:
    n = 2 * max(1, torch.cuda.device_count())  # two workers per GPU: every GPU has two ranks
    with LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


def _sync_on(client: Client, device: str) -> float:
    X, y = dt.datasets.digits(24_000, seed=0, chunks=3_000)
    result = dt.Trainer(_mlp(), strategy="sync", workers=len(live_workers(client)), lr=3e-3,
                        batch_size=128, epochs=2, device=device, progress=False,
                        client=client).fit(X, y, validation=dt.datasets.digits_test())
    assert result.stopped_by == "epochs=2"
    assert all(t["queued_updates"] == (device == "cuda") for t in result.trainers)
    return float(result.history["accuracy"].iloc[-1])


def test_the_sync_trainer_shares_a_gpu_between_two_ranks(shared_client: Client) -> None:
    on_cpu = _sync_on(shared_client, "cpu")
    on_gpu = _sync_on(shared_client, "cuda")
    assert on_gpu >= on_cpu - 0.02, (on_gpu, on_cpu)


def test_dt_run_shares_a_gpu_between_two_ranks_over_gloo(shared_client: Client) -> None:
    X, y = dt.datasets.digits(24_000, seed=0, chunks=3_000)
    runs = {device: dt.run(_run_on_gpu, workers=len(live_workers(shared_client)), device=device,
                           config={"epochs": 2, "device": device}, client=shared_client,
                           data={"train": (X, y), "val": dt.datasets.digits_test()})
            for device in ("cpu", "cuda")}
    assert {device.split(":")[0] for device, _ in runs["cuda"].returns} == {"cuda"}
    assert {backend for _, backend in runs["cuda"].returns} == {"gloo"}
    accuracy = {d: float(r.history["accuracy"].iloc[-1]) for d, r in runs.items()}
    assert accuracy["cuda"] >= accuracy["cpu"] - 0.02, accuracy
