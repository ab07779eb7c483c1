"""``dt.run``: the user's own training loop on a real cluster, with the data, scores, stop
conditions, checkpoints and recovery of a Trainer job. References come from a plain torch loop
written here."""

from __future__ import annotations

import os
import signal
import time

import dask
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dask_train as dt
from dask_train.data._cluster import live_workers
from dask_train.errors import InvalidInput, RoleFailed


def make_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def train(ctx, lr=3e-3, epochs=None, batch_size=64, fail_rank=None, hold_s=0.0, state_on=None):
    """A loop as a user writes it: DDP, AdamW, a checkpoint and the held-out accuracy each epoch
    (the state passed on every rank, or only on rank ``state_on``)."""
    model = ctx.prepare(make_net())
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    state = ctx.restore()
    if state:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    xv, yv = ctx.dataset("val")
    epochs_run, batches = [], 0
    for epoch in ctx.epochs(epochs):
        for xb, yb in ctx.batches("train", batch_size=batch_size):
            if fail_rank == ctx.rank and batches == 3:
                raise ValueError(f"a bad batch on rank {ctx.rank}")
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            batches += 1
            time.sleep(hold_s)
        with torch.no_grad():
            accuracy = (model(xv).argmax(1) == yv).float().mean().item()
        epochs_run.append(epoch)
        ctx.report({"loss": loss.item(), "accuracy": accuracy, "rows": batches},
                   checkpoint={"model": model.module.state_dict(), "opt": opt.state_dict(),
                               "epoch": epoch} if state_on in (None, ctx.rank) else None)
        if ctx.should_stop():
            break
    return {"rank": ctx.rank, "epochs": epochs_run, "batches": batches,
            "restored": None if state is None else state["epoch"],
            "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"])}


@pytest.fixture(scope="module")
def digits():
    X, y = dt.datasets.digits(n_samples=24_000)
    Xv, yv = dt.datasets.digits(n_samples=2_000, seed=7)
    return X.rechunk(1_500), y.rechunk(1_500), np.asarray(Xv), np.asarray(yv)


def plain_torch(X, y, Xv, yv, *, epochs: int, batch: int, lr: float = 3e-3) -> float:
    """The same model, optimizer and global batch in one process: the reference accuracy."""
    torch.manual_seed(0)
    net = make_net()
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    x, t = torch.from_numpy(np.asarray(X)), torch.from_numpy(np.asarray(y))
    for _ in range(epochs):
        order = torch.randperm(len(x))
        for i in range(0, len(x), batch):
            idx = order[i:i + batch]
            opt.zero_grad()
            F.cross_entropy(net(x[idx]), t[idx]).backward()
            opt.step()
    with torch.no_grad():
        return float((net(torch.from_numpy(Xv)).argmax(1) == torch.from_numpy(yv)).float().mean())


def each_epoch_once(result: dt.RunResult, rows: int, epochs: int) -> None:
    consumed = result.ledger.groupby("epoch")["consumed"].sum()
    for epoch in range(epochs):
        assert consumed.get(epoch, 0) == rows, (epoch, consumed.to_dict())


def test_two_ranks_train_as_plain_torch_each_row_once(client, digits, tmp_path):
    X, y, Xv, yv = digits
    result = dt.run(train, workers=2, config={"epochs": 3}, client=client,
                    data={"train": (X, y), "val": (Xv, yv)},
                    checkpoint=dt.CheckpointConfig(tmp_path / "ck", keep=2))
    reference = plain_torch(X.compute(), y.compute(), Xv, yv, epochs=3, batch=128)
    assert result.stopped_by == "trainers ended"
    assert [r["rank"] for r in result.returns] == [0, 1]
    assert all(r["epochs"] == [0, 1, 2] for r in result.returns)
    assert result.returns[1]["env"][:2] == ("1", "2")
    each_epoch_once(result, len(X), 3)
    assert result.epochs_completed == 3 and result.samples == 3 * len(X)
    history = result.history
    assert list(history["epoch"]) == [1.0, 2.0, 3.0]
    # DDP averages the two ranks' 64-row batches: the plain loop's 128-row batch, same epochs.
    assert history["accuracy"].iloc[-1] >= reference - 0.03, (history, reference)
    assert len(result.checkpoints) == 3  # one per report
    assert len([p for p in (tmp_path / "ck").iterdir() if p.name.startswith("ckpt-")]) == 2
    state = result.load_checkpoint()
    assert state["epoch"] == 2 and isinstance(state["opt"]["param_groups"][0]["betas"], tuple)
    assert not list((tmp_path / "ck").rglob("*.pkl"))


def test_stop_at_score_ends_every_rank_after_the_same_report(client, digits):
    X, y, Xv, yv = digits
    result = dt.run(train, workers=2, epochs=50, client=client,
                    data={"train": (X, y), "val": (Xv, yv)},
                    stop=[dt.StopAtScore("accuracy", 0.9)])
    assert result.stopped_by == "StopAtScore(accuracy>=0.9)"
    assert result.history["accuracy"].iloc[-1] >= 0.9
    epochs = [r["epochs"] for r in result.returns]
    assert epochs[0] == epochs[1] and len(epochs[0]) < 50


def test_resume_goes_on_from_the_checkpoints_epoch_and_rows(client, digits, tmp_path):
    X, y, Xv, yv = digits
    common = dict(workers=2, client=client, data={"train": (X, y), "val": (Xv, yv)},
                  checkpoint=dt.CheckpointConfig(tmp_path / "ck"))
    first = dt.run(train, epochs=2, **common)
    again = dt.run(train, epochs=4, resume=True, **common)
    assert [r["restored"] for r in again.returns] == [1, 1]
    assert all(r["epochs"] == [2, 3] for r in again.returns)
    # The history goes on: the first run's two reports, then this one's.
    assert list(again.history["epoch"]) == [1.0, 2.0, 3.0, 4.0]
    assert list(again.history["step"])[:2] == list(first.history["step"])
    each_epoch_once(again, len(X), 4)


class _KillAtFirstScore(dt.Callback):
    """SIGKILLs the worker process ``pid`` at the job's first score (its ``at``-th)."""

    def __init__(self, pid: int, at: int = 1) -> None:
        self.pid, self.done, self.scores = pid, False, 0
        self.at = at

    def on_score(self, record):
        self.scores += 1
        if not self.done and self.scores >= self.at:
            self.done = True
            os.kill(self.pid, signal.SIGKILL)


def test_a_lost_worker_restarts_every_rank_from_the_newest_checkpoint(client, digits, tmp_path):
    X, y, Xv, yv = digits
    pids = client.run(os.getpid)
    victim = pids[sorted(pids)[1]]

    result = dt.run(train, workers=2, epochs=3, client=client,
                    data={"train": (X, y), "val": (Xv, yv)}, callbacks=[_KillAtFirstScore(victim)],
                    checkpoint=dt.CheckpointConfig(tmp_path / "ck"))
    assert result.generations == 2 and len(result.failures) == 1
    assert result.failures[0]["action"] == "restart"
    assert [r["restored"] for r in result.returns] == [0, 0]
    assert all(r["epochs"] == [1, 2] for r in result.returns)
    each_epoch_once(result, len(X), 3)


def test_a_lost_worker_that_held_the_only_state_starts_again_from_scratch(client, digits):
    # No checkpoint=, and only rank 0 passes its state to ctx.report: killed at the first
    # report's score, before the ranks went on and its copy was written, it takes the only
    # state there is with it.
    X, y, Xv, yv = digits
    pids = client.run(os.getpid)
    victim = pids[sorted(pids)[0]]

    result = dt.run(train, workers=2, epochs=2, client=client, config={"state_on": 0},
                    data={"train": (X, y), "val": (Xv, yv)}, callbacks=[_KillAtFirstScore(victim)])
    assert result.generations == 2
    assert all(r["epochs"] == [0, 1] and r["restored"] is None for r in result.returns)
    each_epoch_once(result, len(X), 2)


@pytest.mark.parametrize("memory", ["auto", "workers"])
def test_a_killed_rank_that_alone_held_the_state_goes_on_from_its_copy(client, digits, memory):
    # No checkpoint=, only rank 0 passes its state: after each report, while the ranks go on,
    # the job copies it to memory a worker's death does not take (/dev/shm here, or two other
    # workers' memory as on a cluster of several machines). Rank 0 killed at the third report:
    # the job goes on from the newest copy (the first or second report's), not from scratch.
    X, y, Xv, yv = digits
    pids = client.run(os.getpid)
    victim = pids[sorted(pids)[0]]

    with dask.config.set({"dask-train.memory-state": memory}):
        result = dt.run(train, workers=2, epochs=4, client=client, config={"state_on": 0},
                        data={"train": (X, y), "val": (Xv, yv)},
                        callbacks=[_KillAtFirstScore(victim, at=3)])
    [failure] = result.failures
    assert failure["action"] == "restart" and failure["from"] == "copy", failure
    [restored] = {r["restored"] for r in result.returns}
    assert restored in (0, 1)
    assert all(r["epochs"] == list(range(restored + 1, 4)) for r in result.returns)
    each_epoch_once(result, len(X), 4)


def test_a_killed_rank_0_goes_on_from_the_state_another_rank_reported(client, digits):
    # No checkpoint=, every rank passes the same state (as DDP's ranks hold it): rank 0, the
    # one that writes it, is killed after the first report; rank 1's copy is written instead.
    X, y, Xv, yv = digits
    pids = client.run(os.getpid)
    victim = pids[sorted(pids)[0]]

    result = dt.run(train, workers=2, epochs=3, client=client,
                    data={"train": (X, y), "val": (Xv, yv)}, callbacks=[_KillAtFirstScore(victim)])
    [failure] = result.failures
    assert failure["action"] == "restart" and failure["from"] == "survivors", failure
    assert [r["restored"] for r in result.returns] == [0, 0]
    assert all(r["epochs"] == [1, 2] for r in result.returns)
    each_epoch_once(result, len(X), 3)


def test_a_rank_killed_without_checkpoints_goes_on_from_the_last_report(client, digits):
    # No checkpoint=: rank 0, alive, holds the state it reported at the end of epoch 0; rank 1
    # is killed after that report. The job goes on from it (written to a scratch directory of
    # this machine) instead of from scratch; what was trained since the report is redone.
    X, y, Xv, yv = digits
    pids = client.run(os.getpid)
    victim = pids[sorted(pids)[1]]  # rank 1: ranks are placed in address order

    result = dt.run(train, workers=2, epochs=3, client=client,
                    data={"train": (X, y), "val": (Xv, yv)}, callbacks=[_KillAtFirstScore(victim)])
    [failure] = result.failures
    assert failure["action"] == "restart" and failure["from"] == "survivors", failure
    assert "dt.run job's ranks" in failure["reason"] and "its last report" in failure["reason"]
    assert result.generations == 2
    assert [r["restored"] for r in result.returns] == [0, 0]
    assert all(r["epochs"] == [1, 2] for r in result.returns)
    each_epoch_once(result, len(X), 3)


def test_an_error_in_one_ranks_code_ends_the_run_with_its_traceback(client, digits):
    X, y, Xv, yv = digits
    t0 = time.monotonic()
    with pytest.raises(RoleFailed, match="rank 1 .*ValueError: a bad batch on rank 1") as info:
        dt.run(train, workers=2, epochs=3, client=client, config={"fail_rank": 1},
               data={"train": (X, y), "val": (Xv, yv)}, timeout=60)
    assert time.monotonic() - t0 < 50  # not the group's 60 s timeout: rank 0 is released
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and cause.__traceback__ is not None
    # The workers are free for the next job.
    again = dt.run(train, workers=2, epochs=1, client=client,
                   data={"train": (X, y), "val": (Xv, yv)})
    assert again.stopped_by == "epochs=1"


def test_no_data_targets_only_inputs_and_one_rank(client):
    X = np.random.default_rng(0).normal(size=(4_000, 8)).astype("float32")

    def autoencode(ctx):
        net = ctx.prepare(torch.nn.Sequential(torch.nn.Linear(8, 3), torch.nn.Linear(3, 8)))
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        first = last = None
        for _ in ctx.epochs(3):
            for xb in ctx.batches(batch_size=100):
                opt.zero_grad()
                loss = F.mse_loss(net(xb), xb)
                loss.backward()
                opt.step()
                first = loss.item() if first is None else first
                last = loss.item()
            ctx.report({"loss": last}, reduce="mean")
        return first, last

    result = dt.run(autoencode, workers=1, client=client, data={"train": X})
    [(first, last)] = result.returns
    assert last < first
    assert len(result.history) == 3
    each_epoch_once(result, len(X), 3)


def test_a_job_that_may_grow_runs_its_ddp_code_on_one_rank():
    # workers=(1, 3) on a cluster of one worker (or one left after departures): ctx.prepare
    # wraps the model with DDP's face (.module, no_sync) on the one rank too, so the loop
    # written for several ranks runs; workers=1 gets the bare model, as Ray Train's does.
    from distributed import Client, LocalCluster

    X = np.random.default_rng(0).normal(size=(1_000, 4)).astype("float32")
    y = (X.sum(1) > 0).astype("int64")

    def loop(ctx):
        model = ctx.prepare(torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in ctx.epochs(1):
            for xb, yb in ctx.batches(batch_size=100):
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
            state = getattr(model, "module", model).state_dict()
            ctx.report({"loss": 0.0}, checkpoint={"model": state})
        return type(model).__name__

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as one:
        grows = dt.run(loop, workers=(1, 3), client=one, data={"train": (X, y)})
        fixed = dt.run(loop, workers=1, client=one, data={"train": (X, y)})
    assert grows.returns == ["OneRank"] and fixed.returns == ["Linear"]


def test_a_function_without_data_or_reports(client):
    def hello(ctx, word="hi"):
        return f"{word} from {ctx.rank} of {ctx.world_size} on {ctx.device}"

    result = dt.run(hello, client=client, workers=2, config={"word": "hey"})
    assert result.returns == ["hey from 0 of 2 on cpu", "hey from 1 of 2 on cpu"]


def test_each_rank_has_a_scratch_dir_removed_when_its_function_ends(client):
    def scratch(ctx, fail=False):
        path = ctx.scratch_dir
        assert ctx.scratch_dir == path  # one per rank for the whole run
        with open(os.path.join(path, "written"), "w") as f:
            f.write(str(ctx.rank))
        if fail and ctx.rank == 1:
            raise ValueError(path)
        return path, os.listdir(path)

    result = dt.run(scratch, client=client, workers=2)
    (first, files), (second, _) = result.returns
    assert first != second and files == ["written"]
    # Removed on the workers (which share this machine's disk) when each function returned.
    assert not os.path.exists(first) and not os.path.exists(second)
    with pytest.raises(RoleFailed) as info:
        dt.run(scratch, client=client, workers=2, config={"fail": True})
    failed = str(info.value.__cause__)
    assert "dask-train-rank1-" in failed and not os.path.exists(failed)


def test_reduced_metrics_combine_the_ranks(client, digits):
    X, y, _, _ = digits

    def count(ctx):
        rows = 0
        for _ in ctx.epochs(1):
            for xb, _yb in ctx.batches(batch_size=500):
                rows += len(xb)
        ctx.report({"rows": rows}, reduce="sum")
        ctx.report({"rows": rows})
        return rows

    result = dt.run(count, workers=2, client=client, data={"train": (X, y)})
    assert result.history["rows"].iloc[0] == len(X) == sum(result.returns)
    assert result.history["rows"].iloc[1] == result.returns[0]


def test_bad_arguments_are_named_before_anything_runs(client, digits):
    X, y, _, _ = digits
    with pytest.raises(InvalidInput) as info:
        dt.run(train, client=client, config={"lrr": 1}, workers=(3, 2), batch_size=0,
               data=[X, y], resume=True, device="tpu")
    text = str(info.value)
    for part in ("config={'lrr': 1}", "workers=(3, 2)", "batch_size=0", "data=list",
                 "resume=True needs checkpoint", "device='tpu'"):
        assert part in text, part
    lock = __import__("threading").Lock()

    def closes_over_a_lock(ctx):
        return lock.locked()

    with pytest.raises(InvalidInput, match="cannot be pickled"):
        dt.run(closes_over_a_lock, client=client)
    with pytest.raises(InvalidInput, match=r"data\['big'\] is \d+ MiB"):
        dt.run(train, client=client, data={"train": (X, y),
                                             "big": np.zeros(((80 << 20) // 256, 64), "float32")})


def test_a_metric_named_as_a_history_column_is_refused(client):
    def names_epoch(ctx):
        ctx.report({"epoch": 1.0})

    with pytest.raises(RoleFailed, match=r"names \['epoch'\], which the job's history sets"):
        dt.run(names_epoch, workers=1, client=client)


def test_a_checkpoint_that_is_not_tensors_and_plain_values_is_named(client, digits, tmp_path):
    X, y, _, _ = digits

    def bad(ctx):
        for _ in ctx.epochs(1):
            for _b in ctx.batches():
                pass
            ctx.report({}, checkpoint={"opt": {"fn": lambda: 1}})

    with pytest.raises(RoleFailed, match=r"checkpoint\['opt'\]\['fn'\] is a function"):
        dt.run(bad, workers=1, client=client, data={"train": (X, y)},
               checkpoint=dt.CheckpointConfig(tmp_path))


def test_reports_inside_the_batch_loop_with_uneven_shares(client, tmp_path):
    import dask.array as da

    rng = np.random.default_rng(0)
    X = rng.normal(size=(10_000, 4)).astype("float32")
    y = (X[:, 0] > 0).astype("int64")
    chunks = (4_000, 3_000, 1_000, 1_000, 500, 500)  # shares of 2 ranks cannot be even
    Xd, yd = da.from_array(X, chunks=(chunks, 4)), da.from_array(y, chunks=(chunks,))

    def loop(ctx):
        net = ctx.prepare(torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        inside = 0
        for _ in ctx.epochs(2):
            for i, (xb, yb) in enumerate(ctx.batches(batch_size=100)):
                opt.zero_grad()
                loss = F.cross_entropy(net(xb), yb)
                loss.backward()
                opt.step()
                if i % 5 == 4:
                    ctx.report({"loss": loss.item()}, checkpoint={"net": net.module.state_dict()})
                    inside += 1
            ctx.report({"epoch_end": 1.0})
        return inside

    result = dt.run(loop, workers=2, client=client, data={"train": (Xd, yd)},
                    checkpoint=dt.CheckpointConfig(tmp_path / "ck", keep=1), timeout=60)
    each_epoch_once(result, len(X), 2)
    assert sum(result.returns) > 0 and result.returns[0] != result.returns[1]
    assert result.history["epoch_end"].notna().sum() == 2
    assert len(result.checkpoints) >= max(result.returns)


def test_elastic_workers_and_max_failures_name_the_rank_and_worker(client, digits):
    X, y, Xv, yv = digits
    # (least, most): as many ranks as the cluster has, up to most.
    result = dt.run(train, workers=(1, 3), epochs=1, client=client,
                    data={"train": (X, y), "val": (Xv, yv)})
    assert len(result.returns) == len(live_workers(client)) == 2
    pids = client.run(os.getpid)
    victim_address = sorted(pids)[1]

    class Kill(dt.Callback):
        done = False

        def on_score(self, record):
            if not self.done:
                self.done = True
                os.kill(pids[victim_address], signal.SIGKILL)

    with pytest.raises(dt.WorkerLost) as info:
        dt.run(train, workers=2, epochs=3, client=client, callbacks=[Kill()],
               data={"train": (X, y), "val": (Xv, yv)}, failure=dt.FailureConfig(max_failures=0))
    assert "trainer-1" in str(info.value) and victim_address in str(info.value)
    client.wait_for_workers(2, timeout=60)


def test_scores_and_each_ranks_figures_reach_tensorboard(client, digits, tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "monitor"))
    from _tensorboard_read import read_scalars

    X, y, Xv, yv = digits
    result = dt.run(train, workers=2, epochs=2, client=client,
                    data={"train": (X, y), "val": (Xv, yv)},
                    callbacks=[dt.callbacks.TensorBoard(tmp_path / "tb", flush_secs=1)])
    scalars = read_scalars(tmp_path / "tb")
    assert [step for step, _ in scalars["score/accuracy"]] == list(result.history["step"])
    assert {"trainer/0/samples_per_s", "trainer/1/samples_per_s"} <= set(scalars)


def test_a_dict_of_inputs_reaches_the_function_by_name(client):
    import dask.array as da

    rng = np.random.default_rng(1)
    codes = rng.integers(0, 20, size=(6_000, 1))
    numeric = rng.normal(size=(6_000, 3)).astype("float32")
    y = ((codes[:, 0] % 2 == 0) ^ (numeric[:, 0] > 0)).astype("int64")
    X = {"code": da.from_array(codes, chunks=(1_000, 1)),
         "numeric": da.from_array(numeric, chunks=(1_000, 3))}

    def tabular(ctx):
        seen = set()
        rows = 0
        for _ in ctx.epochs(1):
            for xb, yb in ctx.batches(batch_size=250):
                seen.add((tuple(sorted(xb)), str(xb["code"].dtype), str(xb["numeric"].dtype)))
                assert len(xb["code"]) == len(xb["numeric"]) == len(yb)
                rows += len(yb)
        return sorted(seen), rows

    result = dt.run(tabular, workers=2, client=client, data={"train": (X, da.from_array(y))})
    assert {tuple(s) for r in result.returns for s in r[0]} == {
        (("code", "numeric"), "torch.int64", "torch.float32")}
    assert sum(r[1] for r in result.returns) == 6_000
    each_epoch_once(result, 6_000, 1)
