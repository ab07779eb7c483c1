"""dt.run's data-parallel model on ranks of one host: ``ctx.prepare`` averages the gradients
through host memory (``engines/run/host_parallel.py``) instead of DDP over gloo's loopback.

What DDP guarantees is checked against references computed here with plain torch: the mean of
the ranks' own gradients, every rank holding the same parameters and buffers, ``no_sync``
accumulation, uneven shares (and two models, as a GAN's) never hanging."""

from __future__ import annotations

import dask.array as da
import numpy as np
import torch
import torch.nn.functional as F

import dask_train as dt
from dask_train.engines.run.host_parallel import HostDataParallel


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _flat(module: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy().copy()


def _loop(ctx, epochs=2):  # noqa: ANN001, ANN201
    model = ctx.prepare(_net())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in ctx.epochs(epochs):
        for xb, yb in ctx.batches(batch_size=64):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    return {"params": _flat(model.module), "host": isinstance(model, HostDataParallel)}


def _config(on: bool) -> None:
    import dask

    dask.config.set({"dask-train.host-memory": on})


def test_ranks_average_in_host_memory_train_as_ddp_and_hold_the_same_model(client):
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
    assert [r["host"] for r in shared.returns] == [True, True]
    assert [r["host"] for r in network.returns] == [False, False]  # torch's DDP over gloo
    # Every rank adds the slots in rank order: the ranks never drift apart, to the bit.
    a, b = (r["params"] for r in shared.returns)
    np.testing.assert_array_equal(a, b)
    assert shared.samples == network.samples == 2 * 20_000
    # Other batches per step than the gloo run's (blocks go where they are granted): as good.
    assert accuracy(a) >= accuracy(network.returns[0]["params"]) - 0.03


def test_a_step_applies_the_mean_of_the_ranks_own_gradients(client):
    """The first step's gradient on every rank is the mean of what each rank's batch gives
    alone, recomputed here with plain torch from the batches the ranks return."""
    X, y = dt.datasets.digits(n_samples=4_000)
    X, y = X.rechunk(1_000), y.rechunk(1_000)

    def first_step(ctx):
        model = ctx.prepare(_net())
        for xb, yb in ctx.batches(batch_size=50):
            F.cross_entropy(model(xb), yb).backward()
            grads = [p.grad.clone().numpy() for p in model.parameters()]
            return {"x": xb.numpy(), "y": yb.numpy(), "grads": grads}

    result = dt.run(first_step, workers=2, data={"train": (X, y)}, client=client)
    own = []
    for r in result.returns:
        net = _net()
        F.cross_entropy(net(torch.from_numpy(r["x"])), torch.from_numpy(r["y"])).backward()
        own.append([p.grad.numpy() for p in net.parameters()])
    for i, mean in enumerate(result.returns[0]["grads"]):
        np.testing.assert_array_equal(mean, result.returns[1]["grads"][i])
        np.testing.assert_allclose(mean, (own[0][i] + own[1][i]) / 2, rtol=1e-5, atol=1e-7)


def test_buffers_no_sync_and_two_models_over_uneven_shares(client):
    """BatchNorm's statistics follow rank 0 as DDP's broadcast makes them, and a frozen layer
    starts as rank 0's; no_sync leaves the
    ranks' gradients their own until the next step; two models (a generator and a critic) on
    shares of different lengths end every epoch together, holding the same parameters."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(9_000, 8)).astype("float32")
    y = (X[:, 0] + X[:, 1] > 0).astype("int64")
    chunks = (4_000, 2_500, 1_500, 1_000)  # shares of 2 ranks cannot be even
    Xd, yd = da.from_array(X, chunks=(chunks, 8)), da.from_array(y, chunks=(chunks,))

    def loop(ctx):
        torch.manual_seed(ctx.rank)  # different starts: prepare must make them rank 0's
        critic = ctx.prepare(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                                 torch.nn.ReLU(), torch.nn.Linear(16, 2)))
        gen = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 8))
        gen[0].requires_grad_(False)  # a frozen layer: it too starts as rank 0's
        gen = ctx.prepare(gen)
        started = _flat(critic.module)
        c_opt = torch.optim.SGD(critic.parameters(), lr=0.05)
        g_opt = torch.optim.SGD(gen.parameters(), lr=0.01)
        own_grads_differ, batches = [], 0
        for _ in ctx.epochs(2):
            for i, (xb, yb) in enumerate(ctx.batches(batch_size=100)):
                c_opt.zero_grad()
                if i % 2 == 0:
                    with critic.no_sync():
                        F.cross_entropy(critic(xb), yb).backward()
                    own_grads_differ.append(critic.module[0].weight.grad.clone())
                F.cross_entropy(critic(xb), yb).backward()
                c_opt.step()
                g_opt.zero_grad()
                fake = gen(torch.randn(len(xb), 4))
                F.cross_entropy(critic(fake), torch.zeros(len(xb), dtype=torch.int64)).backward()
                g_opt.step()
                batches += 1
        return {"started": started, "critic": _flat(critic.module), "gen": _flat(gen.module),
                "stats": critic.module[1].running_mean.numpy().copy(), "batches": batches,
                "no_sync_grad": own_grads_differ[0].numpy()}

    result = dt.run(loop, workers=2, data={"train": (Xd, yd)}, client=client, timeout=60)
    r0, r1 = result.returns
    assert r0["batches"] != r1["batches"]  # the shares were uneven
    np.testing.assert_array_equal(r0["started"], r1["started"])
    for key in ("critic", "gen", "stats"):
        np.testing.assert_array_equal(r0[key], r1[key])
    # Inside no_sync the gradient was each rank's own (different data, so different values).
    assert not np.array_equal(r0["no_sync_grad"], r1["no_sync_grad"])
    assert result.samples == 2 * len(X)
