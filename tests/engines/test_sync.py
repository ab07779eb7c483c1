"""Synchronous data-parallel training on a torch process group started by Dask."""

from __future__ import annotations

import dask.array as da
import numpy as np
import torch
from _models import mlp
from distributed import Client

import dask_train as dt
from dask_train.data import block_order


def _data(chunks, n_in: int = 8, n_out: int = 3, seed: int = 0):
    n = sum(chunks)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, n_in)).astype(np.float32)
    y = (x @ rng.normal(size=(n_in, n_out))).argmax(axis=1).astype(np.int64)
    return x, y, da.from_array(x, chunks=(tuple(chunks), n_in)), da.from_array(y, chunks=(tuple(chunks),))


def _rank_batches(ledger, starts, *, batch_size, seed, shuffle, rank):
    """Each batch (as row indices) that ``rank`` trained on, in order."""
    out = []
    for row in ledger[ledger["trainer"] == rank].itertuples():
        order = block_order(rows=row.rows, seed=seed, epoch=row.epoch, block=row.block, shuffle=shuffle)
        for i in range(0, row.rows, batch_size):
            out.append(starts[row.block] + order[i : i + batch_size])
    return out


def _reference(module, x, y, ledger, starts, *, lr, batch_size, seed, shuffle):
    """Single-process SGD where step i trains on the concatenation of every rank's i-th batch."""
    per_rank = [
        _rank_batches(ledger, starts, batch_size=batch_size, seed=seed, shuffle=shuffle, rank=r)
        for r in sorted(set(ledger["trainer"]))
    ]
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    steps = max(len(b) for b in per_rank)
    for i in range(steps):
        idx = np.concatenate([b[i] for b in per_rank if i < len(b)])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x[idx])), torch.from_numpy(y[idx]))
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]), steps


def test_two_ranks_equal_single_process_training_on_concatenated_batches(client: Client) -> None:
    chunks = (500, 500, 300, 700)
    x, y, X, Y = _data(chunks)
    starts = np.concatenate([[0], np.cumsum(chunks)[:-1]])
    trainer = dt.Trainer(
        mlp(8, 16, 3),
        strategy="sync",
        optimizer="sgd",
        lr=0.1,
        workers=2,
        scorer=0,
        batch_size=64,
        epochs=2,
        seed=5,
        progress=False,
        client=client,
    )
    result = trainer.fit(X, Y)
    assert result.stopped_by == "epochs=2"
    expected, steps = _reference(
        mlp(8, 16, 3), x, y, result.ledger, starts, lr=0.1, batch_size=64, seed=5, shuffle=True
    )
    assert result.steps == steps
    assert [t["steps"] for t in result.trainers] == [steps, steps]  # every rank took every step
    got = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert result.samples == 2 * sum(chunks)


def test_uneven_blocks_on_one_worker_finish_the_epoch(client: Client) -> None:
    # Three blocks of very different sizes plus a small one, all persisted on one worker: the
    # other rank must fetch what it reads, and runs out of data long before the first.
    chunks = (3000, 200, 200, 100)
    x, y, X, Y = _data(chunks)
    first = sorted(client.scheduler_info()["workers"])[0]
    X, Y = client.persist([X, Y], workers=[first])
    trainer = dt.Trainer(
        mlp(8, 16, 3),
        strategy="sync",
        lr=1e-3,
        workers=2,
        scorer=0,
        batch_size=32,
        epochs=1,
        timeout=30,
        progress=False,
        client=client,
    )
    result = trainer.fit(X, Y)
    assert result.stopped_by == "epochs=1"
    assert result.epochs_completed == 1
    assert int(result.ledger["consumed"].sum()) == sum(chunks)
    steps = {t["steps"] for t in result.trainers}
    assert len(steps) == 1  # both ranks stepped together to the end


def test_grad_accumulation_cuts_the_all_reduces(client: Client) -> None:
    chunks = (512, 512)
    _, _, X, Y = _data(chunks)
    common = dict(
        strategy="sync", lr=1e-3, workers=2, scorer=0, batch_size=32, epochs=1, progress=False, client=client
    )
    plain = dt.Trainer(mlp(8, 16, 3), **common).fit(X, Y)
    accumulated = dt.Trainer(mlp(8, 16, 3), grad_accumulation=4, **common).fit(X, Y)
    assert plain.steps == 16  # 512 rows per rank / 32
    assert accumulated.steps == 4
    assert accumulated.samples == plain.samples == 1024


def test_sync_scores_and_stops_every_rank_at_the_same_step(client: Client) -> None:
    X, y = dt.datasets.digits(n_samples=200_000, seed=0, chunks=25_000)
    Xv, yv = dt.datasets.digits_test()
    net = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))
    trainer = dt.Trainer(
        net,
        strategy="sync",
        lr=1e-3,
        workers=2,
        scorer=1,
        batch_size=128,
        epochs=5,
        score_every=0.5,
        stop=[dt.StopAtScore("accuracy", 0.93), dt.StopAfter(seconds=120)],
        progress=False,
        client=client,
    )
    result = trainer.fit(X, y, validation=(Xv, yv))
    assert result.stopped_by == "StopAtScore(accuracy>=0.93)"
    assert result.history["accuracy"].iloc[-1] >= 0.93
    assert len({t["steps"] for t in result.trainers}) == 1


def test_sync_stop_at_step_is_exact(client: Client) -> None:
    _, _, X, Y = _data((2000,) * 5)
    trainer = dt.Trainer(
        mlp(8, 16, 3),
        strategy="sync",
        lr=1e-3,
        workers=2,
        scorer=0,
        batch_size=16,
        epochs=10,
        stop=[dt.StopAtStep(40)],
        progress=False,
        client=client,
    )
    result = trainer.fit(X, Y)
    assert result.stopped_by == "StopAtStep(40)"
    assert result.steps == 40
    assert [t["steps"] for t in result.trainers] == [40, 40]


def test_sync_rejects_more_ranks_than_workers(client: Client) -> None:
    _, _, X, Y = _data((100,))
    trainer = dt.Trainer(mlp(8, 16, 3), strategy="sync", workers=3, scorer=0, progress=False, client=client)
    try:
        trainer.fit(X, Y)
    except dt.InvalidInput as err:
        message = str(err)
    else:
        raise AssertionError("fit accepted 3 ranks on 2 workers")
    assert "workers=3 is more than the 2 Dask workers" in message
