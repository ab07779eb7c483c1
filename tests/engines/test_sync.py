"""Synchronous data-parallel training on a torch process group started by Dask."""

from __future__ import annotations

import dask.array as da
import numpy as np
import torch
from _models import mlp
from distributed import Client

import dask_train as dt
from dask_train.data._cluster import live_workers


def _data(chunks, n_in: int = 8, n_out: int = 3, seed: int = 0):
    n = sum(chunks)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, n_in)).astype(np.float32)
    y = (x @ rng.normal(size=(n_in, n_out))).argmax(axis=1).astype(np.int64)
    return x, y, da.from_array(x, chunks=(tuple(chunks), n_in)), da.from_array(y, chunks=(tuple(chunks),))


# The data contract of Trainer(shuffle=True, seed=...), written out here rather than imported, so
# the expected answer does not come from the code under test (pinned on purpose: exact resume and
# reproducible runs depend on it). Epoch e reads the blocks in the order
#   default_rng(SeedSequence([seed, e, 0xB10C])).permutation(n_blocks),
# block b's rows in epoch e in the order default_rng(SeedSequence([seed, e, b])).permutation(rows),
# cut into batches of batch_size (the last smaller), never spanning two blocks. Each rank reads
# the blocks held on its own worker.
def _epoch_blocks(n_blocks: int, *, seed: int, epoch: int) -> list[int]:
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, 0xB10C]))
    return [int(i) for i in rng.permutation(n_blocks)]


def _stream(mine, chunks, *, epochs, batch_size, seed):
    """The batches (row indices) of the rank that holds the blocks ``mine``, in reading order."""
    starts = np.concatenate([[0], np.cumsum(chunks)[:-1]])
    out = []
    for epoch in range(epochs):
        for block in _epoch_blocks(len(chunks), seed=seed, epoch=epoch):
            if block not in mine:
                continue
            rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, block]))
            order = starts[block] + rng.permutation(chunks[block])
            out += [order[i : i + batch_size] for i in range(0, chunks[block], batch_size)]
    return out


def _reference(module, x, y, streams, *, lr):
    """Single-process SGD where step i trains on the concatenation of every rank's i-th batch;
    a rank out of data adds nothing to the steps after its last batch."""
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    steps = max(len(b) for b in streams)
    for i in range(steps):
        idx = np.concatenate([b[i] for b in streams if i < len(b)])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x[idx])), torch.from_numpy(y[idx]))
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]), steps


def _on_worker(client: Client, address: str, *arrays):
    return client.persist(list(arrays), workers=[address], allow_other_workers=False)


def test_two_ranks_equal_single_process_training_on_concatenated_batches(client: Client) -> None:
    result = two_ranks_equal_single_process_training(client)
    assert not any(t["queued_updates"] for t in result.trainers)  # the CPU's own path


def two_ranks_equal_single_process_training(client: Client) -> dt.FitResult:
    """The check, also run on the rank's GPU path (``test_sync_device_steps.py``)."""
    # Which rank reads which block depends on where the blocks live, so the test places them:
    # blocks 0 and 1 on one worker, blocks 2 and 3 on the other. Each rank (one per worker) then
    # reads exactly the blocks on its worker, in each epoch's order: with blocks_ahead=4 every
    # one of the 2 x 4 assignments is granted at the start, round-robin over the ranks, so no rank
    # runs dry and takes a block of the other's while it still has some. Which rank holds which
    # pair does not matter: a step's update is the mean gradient over the union of the ranks'
    # batches, the same whichever order the batches are concatenated in.
    # The two sides hold 1000 and 800 rows: the second rank runs out of data 6 steps before the
    # first and contributes nothing to those steps.
    chunks = (500, 500, 300, 500)
    x, y, _, _ = _data(chunks)
    a, b = sorted(live_workers(client))
    left = _on_worker(client, a, da.from_array(x[:1000], chunks=(500, 8)),
                      da.from_array(y[:1000], chunks=500))
    right = _on_worker(client, b, da.from_array(x[1000:], chunks=((300, 500), 8)),
                       da.from_array(y[1000:], chunks=((300, 500),)))
    X = da.concatenate([left[0], right[0]])
    Y = da.concatenate([left[1], right[1]])
    assert X.chunks[0] == chunks
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
        blocks_ahead=4,
        progress=False,
        client=client,
    )
    result = trainer.fit(X, Y)
    assert result.stopped_by == "epochs=2"
    # The premise of the reference: every block was read on the worker it was placed on.
    assert result.ledger["local"].all()
    streams = [_stream({0, 1}, chunks, epochs=2, batch_size=64, seed=5),
               _stream({2, 3}, chunks, epochs=2, batch_size=64, seed=5)]
    assert [len(s) for s in streams] == [32, 26]  # (8 + 8) and (5 + 8) batches per epoch
    expected, steps = _reference(mlp(8, 16, 3), x, y, streams, lr=0.1)
    assert steps == 32
    assert result.steps == steps
    assert [t["steps"] for t in result.trainers] == [steps, steps]  # every rank took every step
    got = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert result.samples == 2 * sum(chunks)
    return result


def test_uneven_blocks_on_one_worker_finish_the_epoch(client: Client) -> None:
    # Three blocks of very different sizes plus a small one, all persisted on one worker: the
    # other rank must fetch what it reads, and runs out of data long before the first.
    chunks = (3000, 200, 200, 100)
    x, y, X, Y = _data(chunks)
    first = sorted(live_workers(client))[0]
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


def test_one_rank_is_a_plain_loop_with_no_collective(client: Client) -> None:
    # strategy="auto"'s one process: sync with one rank, whose reducer skips every collective
    # (its buffer already holds the sum). All blocks on one worker: the rank reads them in each
    # epoch's order, wherever it runs, and must train exactly as a plain torch loop does.
    chunks = (500, 300, 500)
    x, y, _, _ = _data(chunks)
    a = sorted(live_workers(client))[0]
    X, Y = _on_worker(client, a, da.from_array(x, chunks=(chunks, 8)), da.from_array(y, chunks=(chunks,)))
    result = dt.Trainer(mlp(8, 16, 3), strategy="sync", optimizer="sgd", lr=0.1, workers=1,
                        scorer=0, batch_size=64, epochs=2, seed=5, progress=False,
                        client=client).fit(X, Y)
    stream = _stream({0, 1, 2}, chunks, epochs=2, batch_size=64, seed=5)
    expected, steps = _reference(mlp(8, 16, 3), x, y, [stream], lr=0.1)
    assert result.steps == steps == len(stream) and len(result.roles["trainer"]) == 1
    got = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_a_nonfinite_batch_is_left_out_and_the_next_one_takes_its_place(client: Client) -> None:
    nonfinite_batch_left_out(client)


def nonfinite_batch_left_out(client: Client) -> dt.FitResult:
    """The check, also run on the rank's GPU path (``test_sync_device_steps.py``)."""
    # on_nan="skip": the batch whose loss is not finite adds nothing, the rank reads the next
    # one for the step, and the job trains on as a plain loop that skips that batch would.
    chunks = (500, 300, 500)
    x, y, _, _ = _data(chunks)
    x[600] = np.nan  # one row of block 1
    a = sorted(live_workers(client))[0]
    X, Y = _on_worker(client, a, da.from_array(x, chunks=(chunks, 8)), da.from_array(y, chunks=(chunks,)))
    result = dt.Trainer(mlp(8, 16, 3), strategy="sync", optimizer="sgd", lr=0.1, workers=1,
                        scorer=0, batch_size=64, epochs=1, seed=5, on_nan="skip", progress=False,
                        client=client).fit(X, Y)
    stream = [b for b in _stream({0, 1, 2}, chunks, epochs=1, batch_size=64, seed=5) if 600 not in b]
    expected, steps = _reference(mlp(8, 16, 3), x, y, [stream], lr=0.1)
    assert result.steps == steps and len(result.nonfinite) == 1, result.nonfinite
    got = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    return result
