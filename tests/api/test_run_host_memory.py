"""dt.run's DDP model on ranks of one host: its gradients are averaged through host memory (a DDP
communication hook) instead of gloo's loopback sockets; the same training, every rank holding
the same parameters after every step."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import dask_train as dt


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _loop(ctx, epochs=2):  # noqa: ANN001, ANN201
    model = ctx.prepare(_net())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in ctx.epochs(epochs):
        for xb, yb in ctx.batches(batch_size=64):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    return {"params": flat, "host_memory": [h is not None for h in ctx.host_sums]}


def _config(on: bool) -> None:
    import dask

    dask.config.set({"dask-train.host-memory": on})


def test_ddp_averages_in_host_memory_and_every_rank_holds_the_same_model(client):
    X, y = dt.datasets.digits(n_samples=20_000)
    Xt, yt = dt.datasets.digits_test()
    X, y = X.rechunk(2_500), y.rechunk(2_500)

    def accuracy(params: np.ndarray) -> float:
        net = _net()
        torch.nn.utils.vector_to_parameters(torch.from_numpy(params), net.parameters())
        with torch.no_grad():
            return float((net(torch.from_numpy(Xt)).argmax(1).numpy() == yt).mean())

    shared = dt.run(_loop, workers=2, data={"train": (X, y)}, client=client)
    client.run(_config, False)
    try:
        network = dt.run(_loop, workers=2, data={"train": (X, y)}, client=client)
    finally:
        client.run(_config, True)
    assert [r["host_memory"] for r in shared.returns] == [[True], [True]]
    assert [r["host_memory"] for r in network.returns] == [[False], [False]]
    # The mean every rank gets is bitwise the same: DDP's ranks never drift apart.
    a, b = (r["params"] for r in shared.returns)
    np.testing.assert_array_equal(a, b)
    assert shared.samples == network.samples == 2 * 20_000
    # Other batches per step than the gloo run's (blocks go where they are granted): as good.
    assert accuracy(a) >= accuracy(network.returns[0]["params"]) - 0.03
