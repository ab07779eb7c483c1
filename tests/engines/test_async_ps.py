"""Async parameter-server training end to end on a real LocalCluster with processes."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import dask.array as da
import numpy as np
import pytest
import torch
from _models import Recorder, mlp, over_the_network
from distributed import Client

import dask_train as dt


def _data(n: int = 2000, chunks: int = 500, n_in: int = 8, n_out: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, n_in)).astype(np.float32)
    w = rng.normal(size=(n_in, n_out))
    y = (x @ w).argmax(axis=1).astype(np.int64)
    return x, y, da.from_array(x, chunks=(chunks, n_in)), da.from_array(y, chunks=chunks)


# The data contract of Trainer(shuffle=..., seed=...), written out here rather than imported, so
# the expected answers below do not come from the code under test. Pinned on purpose: exact
# resume and reproducible runs depend on it, so changing it must be a deliberate change of these
# tests too.
#   * shuffle=False: blocks in index order every epoch, rows of a block in their stored order.
#   * shuffle=True: epoch e reads the blocks in the order
#       default_rng(SeedSequence([seed, e, 0xB10C])).permutation(n_blocks)
#     and block b's rows in epoch e in the order
#       default_rng(SeedSequence([seed, e, b])).permutation(rows_of_b).
#   * batches are cut from a block's row order, batch_size at a time, the last one smaller;
#     a batch never spans two blocks.
def _epoch_blocks(n_blocks: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n_blocks))
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, 0xB10C]))
    return [int(i) for i in rng.permutation(n_blocks)]


def _rows(rows: int, *, seed: int, epoch: int, block: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(rows)
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, block])).permutation(rows)


def _one_trainer_plan(chunks, *, epochs: int, seed: int, shuffle: bool) -> list[tuple[int, int]]:
    """(epoch, block) in the order the only trainer reads them: with one trainer nothing depends
    on placement or timing, it reads every block of an epoch in the epoch's order."""
    n = len(chunks)
    return [(e, b) for e in range(epochs) for b in _epoch_blocks(n, seed=seed, epoch=e, shuffle=shuffle)]


def _reference(module, x, y, chunks, plan, *, lr, batch_size, shuffle, seed, accumulate=1):
    """A plain single-process SGD loop over the blocks in ``plan``'s order.

    With ``accumulate`` k, each update averages the gradients of k consecutive batches of one block.
    """
    starts = np.concatenate([[0], np.cumsum(chunks)[:-1]])
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    for epoch, block in plan:
        rows = chunks[block]
        order = starts[block] + _rows(rows, seed=seed, epoch=epoch, block=block, shuffle=shuffle)
        batches = [order[i : i + batch_size] for i in range(0, rows, batch_size)]
        for g in range(0, len(batches), accumulate):  # groups of batches, never across blocks
            group = batches[g : g + accumulate]
            opt.zero_grad()
            for idx in group:
                out = module(torch.from_numpy(x[idx]))
                loss = torch.nn.functional.cross_entropy(out, torch.from_numpy(y[idx])) / len(group)
                loss.backward()
            opt.step()
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _read_order(ledger) -> list[tuple[int, int]]:
    return [(int(e), int(b)) for e, b in zip(ledger["epoch"], ledger["block"])]


@pytest.mark.parametrize("ps,shuffle", [(1, False), (3, True)])
def test_one_trainer_equals_a_plain_torch_loop(client: Client, ps: int, shuffle: bool) -> None:
    x, y, X, Y = _data()
    net = mlp(8, 16, 3)
    trainer = dt.Trainer(
        net,
        optimizer="sgd",
        lr=0.05,
        ps=ps,
        workers=1,
        scorer=0,
        batch_size=64,
        epochs=2,
        shuffle=shuffle,
        seed=7,
        prefetch=False,
        progress=False,
        client=client,
    )
    before = set(client.futures)  # an earlier test's, released in their own time
    result = trainer.fit(X, Y)
    assert result.stopped_by == "epochs=2"
    chunks = (500, 500, 500, 500)  # as _data chunks them
    plan = _one_trainer_plan(chunks, epochs=2, seed=7, shuffle=shuffle)
    assert len(plan) == 8  # 4 blocks x 2 epochs
    assert _read_order(result.ledger) == plan  # the ledger reports the order the test expects
    expected = _reference(mlp(8, 16, 3), x, y, chunks, plan, lr=0.05, batch_size=64, shuffle=shuffle,
                          seed=7)
    got = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])
    assert result.steps == 2 * 4 * 8  # ceil(500 / 64) = 8 batches per block
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # Nothing of the job stays on the cluster: blocks, roles and feeds are all released.
    gc.collect()
    assert not set(client.futures) - before
    # The user's module is never modified in place.
    torch.testing.assert_close(
        torch.cat([p.detach().reshape(-1) for p in net.parameters()]),
        torch.cat([p.detach().reshape(-1) for p in mlp(8, 16, 3).parameters()]),
    )


def test_each_sample_is_consumed_exactly_once_per_epoch(client: Client, tmp_path: Path) -> None:
    n = 3000
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    x[:, 0] = np.arange(n)  # the sample id, exact in float32
    y = rng.integers(0, 2, size=n)
    X = da.from_array(x, chunks=((700, 300, 1000, 500, 500), (4,)))
    Y = da.from_array(y, chunks=((700, 300, 1000, 500, 500),))
    module = Recorder(str(tmp_path), 4, 2)
    trainer = dt.Trainer(
        module, lr=1e-3, ps=1, workers=2, scorer=0, batch_size=32, epochs=1, progress=False, client=client
    )
    result = trainer.fit(X, Y)
    ids = np.concatenate([np.loadtxt(p, dtype=np.int64, ndmin=1) for p in tmp_path.glob("ids-*.txt")])
    assert len(ids) == n
    assert np.array_equal(np.sort(ids), np.arange(n))
    assert result.samples == n
    assert sorted(result.ledger["block"]) == [0, 1, 2, 3, 4]
    assert (result.ledger["consumed"] == result.ledger["rows"]).all()
    assert set(result.ledger["trainer"]) == {0, 1}  # both trainers took part
    assert result.epochs_completed == 1


def test_two_trainers_reach_the_target_on_digits(client: Client) -> None:
    X, y = dt.datasets.digits(n_samples=400_000, seed=0)
    Xv, yv = dt.datasets.digits_test()
    net = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))
    trainer = dt.Trainer(
        net,
        lr=1e-3,
        ps=2,
        workers=2,
        scorer=1,
        batch_size=128,
        epochs=3,
        stop=[dt.StopAtScore("accuracy", 0.95), dt.StopAfter(seconds=240)],
        score_every=0.5,
        progress=False,
        client=client,
    )
    result = trainer.fit(X, y, validation=(Xv, yv))
    assert result.stopped_by == "StopAtScore(accuracy>=0.95)"
    final = result.history.iloc[-1]
    assert final["accuracy"] >= 0.95
    # The returned module really is the trained one: score it here, in the test process.
    with torch.no_grad():
        acc = (result.model(torch.from_numpy(Xv)).argmax(1).numpy() == yv).mean()
    assert acc >= 0.95
    assert list(result.history.columns[:7]) == [
        "time_s",
        "step",
        "epoch",
        "samples",
        "accuracy",
        "loss",
        "samples_per_s",
    ]
    assert result.history["step"].is_monotonic_increasing
    assert set(result.trainers[0]) >= {"steps", "samples"}
    assert all(t["steps"] > 0 for t in result.trainers)


def test_stop_at_step_is_exact(client: Client) -> None:
    _, _, X, Y = _data(n=20_000, chunks=2000)
    trainer = dt.Trainer(
        mlp(8, 16, 3),
        lr=1e-3,
        ps=2,
        workers=2,
        scorer=0,
        batch_size=16,
        epochs=50,
        stop=[dt.StopAtStep(150)],
        progress=False,
        client=client,
    )
    result = trainer.fit(X, Y)
    assert result.stopped_by == "StopAtStep(150)"
    assert result.steps == 150
    assert sum(t["steps"] for t in result.trainers) >= 150


def test_stop_after_a_deadline(client: Client) -> None:
    _, _, X, Y = _data(n=20_000, chunks=2000)
    x_val, y_val, _, _ = _data(n=200, seed=1)
    trainer = dt.Trainer(
        mlp(8, 16, 3),
        lr=1e-3,
        ps=1,
        workers=2,
        batch_size=8,
        epochs=1000,
        stop=[dt.StopAfter(seconds=1)],  # a second is as much a deadline as three
        progress=False,
        client=client,
    )
    result = trainer.fit(X, Y, validation=(x_val, y_val))
    assert result.stopped_by == "StopAfter(1s)"
    assert result.epochs_completed < 1000
    assert 1 <= result.history["time_s"].iloc[-1] < 60


def test_early_stopping_on_a_plateau(client: Client) -> None:
    _, _, X, Y = _data(n=20_000, chunks=2000)
    x_val, y_val, _, _ = _data(n=200, seed=1)
    # A learning rate this small leaves the loss flat: a plateau by construction.
    trainer = dt.Trainer(
        mlp(8, 16, 3),
        optimizer="sgd",
        lr=1e-12,
        ps=1,
        workers=2,
        batch_size=8,
        epochs=1000,
        score_every=0.2,
        stop=[dt.EarlyStopping("loss", patience=3, min_delta=1e-4), dt.StopAfter(seconds=120)],
        progress=False,
        client=client,
    )
    result = trainer.fit(X, Y, validation=(x_val, y_val))
    assert result.stopped_by == "EarlyStopping(loss, patience=3, min_delta=0.0001)"
    assert 4 <= len(result.history) <= 6  # the best, three without improvement, the final score


def test_a_callback_can_stop_the_job(client: Client) -> None:
    class StopOnFirstScore(dt.Callback):
        def on_score(self, record):
            return True

    _, _, X, Y = _data(n=20_000, chunks=2000)
    x_val, y_val, _, _ = _data(n=200, seed=1)
    history = dt.History()
    trainer = dt.Trainer(
        mlp(8, 16, 3),
        lr=1e-3,
        ps=1,
        workers=1,
        batch_size=8,
        epochs=1000,
        score_every=0.2,
        callbacks=[history, StopOnFirstScore()],
        progress=False,
        client=client,
    )
    result = trainer.fit(X, Y, validation=(x_val, y_val))
    assert result.stopped_by == "callback"
    assert len(history.records) >= 1
    assert history.result is result


def test_dask_dataframe_input(client: Client) -> None:
    import dask.dataframe as dd
    import pandas as pd

    x, y, _, _ = _data(n=1200)
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(x.shape[1])])
    X = dd.from_pandas(frame, npartitions=3)
    Y = dd.from_pandas(pd.Series(y, name="label"), npartitions=3)
    trainer = dt.Trainer(
        mlp(8, 16, 3),
        lr=1e-2,
        ps=1,
        workers=2,
        scorer=0,
        batch_size=32,
        epochs=2,
        progress=False,
        client=client,
    )
    result = trainer.fit(X, Y)
    assert result.stopped_by == "epochs=2"
    assert result.samples == 2 * 1200
    assert result.ledger.groupby("epoch")["consumed"].sum().tolist() == [1200, 1200]


def test_grad_accumulation_equals_a_plain_loop_on_batch_groups(client: Client) -> None:
    x, y, X, Y = _data()
    trainer = dt.Trainer(
        mlp(8, 16, 3),
        optimizer="sgd",
        lr=0.05,
        ps=2,
        workers=1,
        scorer=0,
        batch_size=64,
        epochs=1,
        grad_accumulation=3,
        shuffle=True,
        seed=3,
        prefetch=False,
        progress=False,
        client=client,
    )
    result = trainer.fit(X, Y)
    # 8 batches per block in groups of 3, 3 and 2: 3 updates per block, 4 blocks.
    assert result.steps == 12
    chunks = (500, 500, 500, 500)
    plan = _one_trainer_plan(chunks, epochs=1, seed=3, shuffle=True)
    assert _read_order(result.ledger) == plan
    expected = _reference(
        mlp(8, 16, 3), x, y, chunks, plan, lr=0.05, batch_size=64, shuffle=True, seed=3, accumulate=3
    )
    got = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_deeper_prefetch_still_feeds_each_sample_once(client: Client) -> None:
    _, _, X, Y = _data(n=4000)
    trainer = dt.Trainer(
        mlp(8, 16, 3),
        lr=1e-3,
        ps=1,
        workers=2,
        scorer=0,
        batch_size=16,
        epochs=2,
        prefetch=3,
        progress=False,
        client=client,
    )
    result = trainer.fit(X, Y)
    assert result.samples == 8000
    assert result.steps == 2 * 8 * 32  # 8 blocks of 500 rows: 32 batches each (the last of 4)
    assert result.epochs_completed == 2


def test_auto_prefetch_adds_pushes_in_flight_while_waits_dominate() -> None:
    from dask_train.engines.ps.trainer import AUTO_MAX_DEPTH, _Adapt

    adapt, depth = _Adapt(window=4), 1
    for _ in range(40):  # waiting 60% of the time: one more in flight per window, up to the cap
        depth = adapt.next_depth(depth, busy_s=0.4, waited_s=0.6)
    assert depth == AUTO_MAX_DEPTH
    for _ in range(40):  # no waiting any more: back down to one
        depth = adapt.next_depth(depth, busy_s=1.0, waited_s=0.0)
    assert depth == 1
    for _ in range(8):  # in between (10%): stays
        depth = adapt.next_depth(2, busy_s=0.9, waited_s=0.1)
        assert depth == 2


def test_auto_prefetch_goes_deeper_for_a_tiny_model(client: Client) -> None:
    # A 8-16-3 MLP's gradient on 16 rows takes far less than a round trip to the server (over
    # the network: a trainer on the server's host updates it in host memory, without waiting).
    _, _, X, Y = _data(n=8000)
    with over_the_network(client):
        result = dt.Trainer(mlp(8, 16, 3), lr=1e-3, ps=1, workers=2, scorer=0, batch_size=16,
                            epochs=2, prefetch="auto", progress=False, client=client).fit(X, Y)
    assert result.samples == 16_000 and result.steps == 2 * 16 * 32
    assert max(t["prefetch"] for t in result.trainers) >= 2


def _profile_roles(value: bool) -> None:
    import dask

    dask.config.set({"dask-train.profile-roles": value})  # this worker's config, for good


def _profiler_running(dask_worker) -> bool | None:
    callback = dask_worker.periodic_callbacks.get("profile")
    return None if callback is None else bool(callback.is_running())


class _ProfilerSeen(dt.Callback):
    """Asks every worker at each score whether Dask's profiler runs there."""

    def __init__(self, client: Client) -> None:
        self.client, self.seen = client, []

    def on_score(self, record):
        self.seen.append(self.client.run(_profiler_running))


@pytest.mark.parametrize("keep", [False, True])
def test_the_profiler_is_paused_where_roles_run_and_back_after(client: Client, keep: bool) -> None:
    """While a trainer runs on a worker, Dask's statistical profiler there is paused (its 10 ms
    wake-ups slowed the trainers); it runs again after the fit; dask-train.profile-roles keeps it."""
    x, y, X, Y = _data(n=4000)
    seen = _ProfilerSeen(client)
    client.run(_profile_roles, keep)  # a worker setting: the roles read it where they run
    try:
        result = dt.Trainer(mlp(8, 3), loss="cross_entropy", lr=0.05, strategy="async-ps",
                            workers=2, ps=1, batch_size=32, epochs=200, score_every=0.2,
                            stop=[dt.StopAfter(seconds=2)], callbacks=[seen], progress=False,
                            client=client).fit(X, Y, validation=(x[:200], y[:200]))
    finally:
        client.run(_profile_roles, False)
    assert result.steps > 0 and len(seen.seen) >= 2
    trainers = {t["worker"] for t in result.trainers}
    # Callbacks run on their own thread, late under load: a snapshot may come after the roles
    # ended. Paused: some snapshot (taken while they ran) sees every trainer's worker paused;
    # kept: none ever sees one paused.
    if keep:
        assert all(s[w] is True for s in seen.seen for w in trainers), seen.seen
    else:
        assert any(all(s[w] is False for w in trainers) for s in seen.seen), seen.seen
    # Started again once the roles ended (the last one's task may end just after the fit).
    deadline = time.monotonic() + 10
    while not all((after := client.run(_profiler_running)).values()) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(after.values()), after
