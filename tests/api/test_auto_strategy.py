"""``strategy="auto"`` on a real cluster: the costs probed, a choice made, logged and kept in the
result, and the job trained by it as well as plain torch trains the same model."""

from __future__ import annotations

import logging
import os

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt
from dask_train.engines.holders import host_memory


def _data(n: int = 8_000) -> tuple[da.Array, da.Array, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n + 1_000, 8)).astype(np.float32)
    y = (x @ np.random.default_rng(1).normal(size=(8, 3))).argmax(axis=1)
    return (da.from_array(x[:n], chunks=(1_000, 8)), da.from_array(y[:n], chunks=1_000),
            (x[n:], y[n:]))


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def _plain_torch(x: np.ndarray, y: np.ndarray, validation: tuple[np.ndarray, np.ndarray], *,
                 epochs: int, batch_size: int, lr: float) -> float:
    """The reference: the same module, loss, optimizer and batches in one plain torch loop."""
    net, gen = _net(), torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(epochs):
        order = torch.randperm(len(xt), generator=gen)
        for i in range(0, len(xt), batch_size):
            rows = order[i : i + batch_size]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xt[rows]), yt[rows]).backward()
            opt.step()
    with torch.no_grad():
        out = net(torch.from_numpy(validation[0])).argmax(1).numpy()
    return float((out == validation[1]).mean())


def test_auto_chooses_logs_and_trains_to_the_reference(client: Client,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    X, Y, validation = _data()
    reference = _plain_torch(X.compute(), Y.compute(), validation, epochs=2, batch_size=32,
                             lr=1e-2)
    trainer = dt.Trainer(_net(), strategy="auto", ps="auto", workers=2, lr=1e-2, batch_size=32,
                         epochs=2, progress=False, timeout=60, client=client)
    with caplog.at_level(logging.INFO, logger="dask_train"):
        result = trainer.fit(X, Y, validation=validation)
    lines = [r.getMessage() for r in caplog.records if "strategy='auto'" in r.getMessage()]
    assert len(lines) == 1, lines
    plan = result.plan
    chosen = plan["chosen"]
    assert chosen in ("one-process", "sync", "async-ps")
    assert lines[0].startswith(f"strategy='auto': {chosen} (strategy={plan['strategy']!r}")
    # Every candidate predicted and logged, with what limits it.
    assert set(plan["predicted_samples_per_s"]) == {"one-process", "sync", "async-ps"}
    assert all(rate > 0 for rate in plan["predicted_samples_per_s"].values())
    for name in ("one-process (1 trainer): ", "sync (2 ranks): ", "async-ps (2 trainers"):
        assert name in lines[0]
    assert plan["probe_s"] > 0
    # The cores the trainers got, measured: at least one, at most the machine's.
    assert 1.0 <= plan["cores"] <= (os.cpu_count() or 1)
    # One machine: every candidate's whole step was measured there, not predicted; the
    # measurement's segments are gone.
    assert set(plan["bottlenecks"].values()) == {"its whole step, measured on this machine"}
    # (Those of this cluster's workers: another test process may be measuring meanwhile.)
    pids = set(client.run(os.getpid).values())
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("dask-train-probe-")
                and host_memory.owner(os.path.join("/dev/shm", n)) in pids]
    # The roles are the choice's.
    expect = {"one-process": ("sync", 1, 0), "sync": ("sync", 2, 0)}.get(chosen)
    if expect is not None:
        assert (plan["strategy"], plan["workers"], plan["ps"]) == expect
        assert len(result.roles["trainer"]) == expect[1] and not result.roles["ps"]
    else:
        assert plan["strategy"] == "async-ps" and len(result.roles["ps"]) == plan["ps"] >= 1
    assert result.summary()["strategy"] == chosen
    assert trainer.get_params()["strategy"] == "auto"  # the hyper-parameter is kept as given
    # Every row trained twice, to plain torch's accuracy (async staleness gets a little room).
    assert result.samples == 2 * 8_000
    assert result.history["accuracy"].iloc[-1] >= reference - 0.05, reference


def test_strategy_is_named_when_wrong_and_a_plan_kept_when_given(client: Client) -> None:
    X, Y, validation = _data(2_000)
    with pytest.raises(dt.InvalidInput) as info:
        dt.Trainer(_net(), strategy="fastest", progress=False, client=client).fit(X, Y)
    assert "strategy='fastest' is unknown: use one of ['async-ps', 'sync', 'auto']" in \
        str(info.value)
    result = dt.Trainer(_net(), strategy="sync", workers=2, batch_size=64, epochs=1,
                        progress=False, client=client).fit(X, Y, validation=validation)
    assert result.plan == {"strategy": "sync", "workers": 2, "ps": 0}
    assert result.summary()["strategy"] == "sync"


def test_a_numpy_model_runs_its_only_engine_under_auto(client: Client) -> None:
    X, Y, validation = _data(2_000)
    result = dt.Trainer(dt.softmax_regression(8, 3), strategy="auto", lr=0.05, batch_size=256,
                        epochs=1, progress=False, client=client).fit(X, Y, validation=validation)
    assert result.plan == {"strategy": "sync"} and result.samples == 2_000


def test_the_candidates_measured_are_all_or_none() -> None:
    from dask_train.api._auto_measure import candidate_shapes
    from dask_train.api._plan import FitPlan

    def trainer(workers: int, global_batch: int | None = 128) -> FitPlan:
        params = dt.Trainer(torch.nn.Linear(4, 2), global_batch_size=global_batch, batch_size=32,
                            workers=workers).get_params()
        return FitPlan.of(params, model=params["module"])

    # Rows as choose_strategy counts them: the global batch split over the trainers.
    assert candidate_shapes(trainer(2), 2) == {"one-process": (128, 1), "sync": (64, 2),
                                               "async-ps": (64, 2)}
    assert candidate_shapes(trainer(2, None), 2) == {"one-process": (32, 1), "sync": (32, 2),
                                                     "async-ps": (32, 2)}
    # One trainer: no sync candidate; async-ps with one trainer on its shard.
    assert candidate_shapes(trainer(1), 2) == {"one-process": (128, 1), "async-ps": (128, 1)}
    # More trainers than workers: none measured, so none is compared with a prediction.
    assert candidate_shapes(trainer(3), 2) == {}
