"""Surviving lost workers: real worker processes SIGKILLed mid-training, each on its own cluster.

Each test asserts what was kept: every sample of every epoch applied exactly once (the servers'
sample count and the ledger), the steps, and the accuracy still reached.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster

import dask_train as dt
from dask_train.data._cluster import live_workers

sys.path.insert(0, str(Path(__file__).parents[1] / "engines"))
sys.path.insert(0, str(Path(__file__).parent))
from _dask_cli import EXIT_S  # noqa: E402
from _models import DiesAt, Slow, mlp  # noqa: E402


@pytest.fixture(scope="module")
def cluster_client() -> Iterator[Client]:
    # A cluster of its own: these tests kill its workers (the nanny restarts them). One for the
    # module: one per test cost a start and a close of two processes, nine times.
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            yield client


@pytest.fixture()
def own_client(cluster_client: Client) -> Client:
    cluster_client.wait_for_workers(2, timeout=60)  # the last test's victim is back
    return cluster_client


def _data(n: int = 12_000, chunks: int = 1000, n_in: int = 8, n_out: int = 3):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, n_in)).astype(np.float32)
    y = (x @ rng.normal(size=(n_in, n_out))).argmax(axis=1)
    X, Y = da.from_array(x, chunks=(chunks, n_in)), da.from_array(y, chunks=chunks)
    return X, Y, (x[:2000], y[:2000])


class _KillAt(dt.Callback):
    """Kills a worker process once the servers have applied ``samples`` samples."""

    def __init__(self, client: Client, victim: str, samples: int) -> None:
        self.pid = client.run(os.getpid, workers=[victim])[victim]
        self.samples = samples
        self.killed_at: float | None = None

    def on_score(self, record):
        if self.killed_at is None and record["samples"] >= self.samples:
            os.kill(self.pid, signal.SIGKILL)
            self.killed_at = time.monotonic()
        return None


def _trainer(client: Client, module: torch.nn.Module | None = None, **kw) -> dt.Trainer:
    options = dict(lr=1e-2, ps=1, workers=2, batch_size=32, epochs=2, score_every=0.2,
                   timeout=30, progress=False, client=client)
    options.update(kw)
    return dt.Trainer(module or mlp(8, 16, 3), **options)


def _dies_at(client: Client, victim: str, batches: int) -> torch.nn.Module:
    """The job's module; the victim's process SIGKILLs itself at its ``batches``-th training step
    (mid-epoch, however fast the trainers run: a two-epoch job here trains in 0.2 s)."""
    pid = client.run(os.getpid, workers=[victim])[victim]
    return DiesAt(mlp(8, 16, 3), pid, batches)


def _assert_every_sample_once(result: dt.FitResult, rows: int, epochs: int) -> None:
    ledger = result.ledger
    assert result.epochs_completed == epochs
    per_block = ledger.groupby(["epoch", "block"])["consumed"].sum()
    assert len(per_block) == epochs * (rows // 1000)
    assert (per_block == 1000).all()
    assert result.samples == epochs * rows  # the servers applied each sample once


def test_async_trainer_killed_mid_epoch_the_survivor_takes_its_rows(own_client: Client) -> None:
    X, Y, validation = _data()
    roles = dt.start_roles(own_client, ps=1, worker=2, scorer=1)
    # worker-1's process also holds the scorer: one kill, two lost roles.
    victim = roles["trainer"][1]
    assert victim not in roles["ps"]
    module = _dies_at(own_client, victim, batches=50)  # 1600 of its ~6000 rows of epoch 1
    started = time.monotonic()
    result = _trainer(own_client, module).fit(X, Y, validation=validation)
    actions = {f["role"]: f["action"] for f in result.failures}
    assert actions == {"trainer-1": "continue", "scorer-0": "replace"}
    _assert_every_sample_once(result, 12_000, 2)
    moved = result.ledger[result.ledger["moved_from"].notna()]
    assert len(moved) and (moved["trainer"] != 1).all()
    assert result.history["accuracy"].iloc[-1] > 0.85
    assert time.monotonic() - started < 120


def test_numpy_input_lost_with_its_worker_is_sent_again(own_client: Client,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    # In-memory input is scattered in blocks (Dask cannot recompute those): the blocks on the
    # killed worker come back from the client's arrays, and the survivor trains on them.
    _, _, validation = _data()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12_000, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 3))).argmax(axis=1)
    roles = dt.start_roles(own_client, ps=1, worker=2, scorer=1)
    module = _dies_at(own_client, roles["trainer"][1], batches=50)
    with caplog.at_level(logging.INFO, logger="dask_train.data._blocks"):
        result = _trainer(own_client, module).fit(x, y, validation=validation)
    assert [f["role"] for f in result.failures if f["role"].startswith("trainer")] == ["trainer-1"]
    assert any("sent again" in r.getMessage() for r in caplog.records)
    assert result.epochs_completed == 2 and result.samples == 2 * 12_000
    per_block = result.ledger.groupby(["epoch", "block"])["consumed"].sum()
    assert per_block.sum() == 2 * 12_000 and len(per_block) == 2 * 16
    assert result.history["accuracy"].iloc[-1] > 0.85


def _dask_worker(address: str, log: Any) -> subprocess.Popen[bytes]:
    """A ``dask worker`` process without a nanny, as a batch job starts one: killed, it is
    gone for good."""
    dask = str(Path(sys.executable).parent / "dask")
    # faulthandler: a worker that does not exit is sent SIGABRT and prints its threads' stacks.
    return subprocess.Popen([dask, "worker", address, "--no-nanny", "--nthreads", "1",
                             "--host", "127.0.0.1", "--no-dashboard"], stdout=log, stderr=log,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})


def _terminate(workers: list[subprocess.Popen[bytes]], log: Path) -> None:
    """SIGTERM each worker and wait for it; one still running after ``EXIT_S`` fails the test
    with its threads' stacks (``EXIT_S`` says why 30 s was too short)."""
    for process in workers:
        process.terminate()
    stuck = []
    for process in workers:
        try:
            process.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            process.wait(10)
            stuck.append(process.pid)
    assert not stuck, f"workers {stuck} did not exit {EXIT_S:g} s after SIGTERM:\n" + \
        log.read_text()[-20_000:]


class _KillAllThenStart(dt.Callback):
    """SIGKILLs every worker at once once the servers have applied ``samples`` samples (a
    power cut, every batch job lost), and starts two new workers ``after`` seconds later."""

    def __init__(self, address: str, workers: list[subprocess.Popen[bytes]], log: Any,
                 samples: int, after: float) -> None:
        self.address, self.workers, self.log = address, workers, log
        self.samples, self.after, self.done = samples, after, False

    def on_score(self, record):
        if not self.done and record["samples"] >= self.samples:
            self.done = True
            for process in list(self.workers):
                process.kill()
            threading.Timer(self.after, self._start).start()
        return None

    def _start(self) -> None:
        self.workers += [_dask_worker(self.address, self.log) for _ in range(2)]


def test_a_job_whose_every_worker_is_killed_at_once_waits_for_new_ones(tmp_path: Path) -> None:
    # No worker is alive for seconds: the job waits (up to timeout=) for workers to join,
    # instead of failing with its checkpoint in hand, and goes on from it on the new ones.
    X, Y, validation = _data()
    with LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client, (tmp_path / "workers.log").open("w") as log:
        workers = [_dask_worker(cluster.scheduler_address, log) for _ in range(2)]
        try:
            client.wait_for_workers(2, timeout=60)
            old = set(live_workers(client))
            kill = _KillAllThenStart(cluster.scheduler_address, workers, log, samples=6_000,
                                     after=2.0)
            config = dt.CheckpointConfig(str(tmp_path / "ckpt"), every_seconds=None,
                                         every_steps=40, keep=3)
            result = _trainer(client, Slow(mlp(8, 16, 3), 0.002), checkpoint=config,
                              failure=dt.FailureConfig(max_failures=5),
                              callbacks=[kill]).fit(X, Y, validation=validation)
        finally:
            log.flush()
            _terminate(workers, tmp_path / "workers.log")
    assert kill.done and result.generations >= 2
    assert "restart" in {f["action"] for f in result.failures}, result.failures
    assert not set(result.roles.addresses) & old  # it went on on the new workers
    _assert_every_sample_once(result, 12_000, 2)


def test_parameter_server_killed_restarts_from_the_checkpoint(own_client: Client, tmp_path: Path) -> None:
    X, Y, validation = _data()
    roles = dt.start_roles(own_client, ps=1, worker=2, scorer=1)
    victim = roles["ps"][0]  # its process holds a trainer too: killed at that one's 90th step
    module = _dies_at(own_client, victim, batches=90)
    config = dt.CheckpointConfig(str(tmp_path), every_seconds=None, every_steps=60, keep=3)
    result = _trainer(own_client, module, checkpoint=config).fit(X, Y, validation=validation)
    assert result.failures[0]["role"] == "ps-0"
    assert result.failures[0]["action"] == "restart"
    assert result.generations == 2
    _assert_every_sample_once(result, 12_000, 2)
    assert result.history["accuracy"].iloc[-1] > 0.85
    # The new generation was placed on the live workers, the restarted one (new address) included.
    assert len(result.roles.addresses) == 2
    assert set(result.roles.addresses) - set(roles.addresses)


def _files_held(client: Client) -> dict[str, list[str]]:
    """The files each worker keeps for jobs in its memory (runtime._worker_files)."""
    return client.run(lambda dask_worker: sorted(getattr(dask_worker, "dask_train_files", {})))


@pytest.mark.parametrize("where", ["auto", "workers"])
def test_a_server_killed_without_checkpoints_goes_on_from_the_copy_in_memory(
        own_client: Client, caplog: pytest.LogCaptureFixture, where: str) -> None:
    # No checkpoint=: the job keeps a copy of its state in memory (every 0.1 s here,
    # dask-train.copy-every): every worker is on this machine, so in /dev/shm ("auto"), or,
    # as on a cluster of several machines, in two workers' memory ("workers"). The server's
    # worker is killed half way through, and the job goes on from the newest copy: it trains
    # again what was applied since that copy, not everything since the start. (Each batch of 8
    # takes 5 ms: about 3,200 samples a second, so copies come many times before the kill, on
    # any machine.)
    X, Y, validation = _data(n=4_000)
    roles = dt.start_roles(own_client, ps=1, worker=2, scorer=1)
    kill = _KillAt(own_client, roles["ps"][0], samples=4_000)
    with dask.config.set({"dask-train.copy-every": 0.1, "dask-train.memory-state": where}), \
            caplog.at_level(logging.INFO, logger="dask_train"):
        result = _trainer(own_client, Slow(mlp(8, 16, 3), 0.005), callbacks=[kill],
                          batch_size=8).fit(X, Y, validation=validation)
    assert kill.killed_at is not None
    [failure] = [f for f in result.failures if f["role"] == "ps-0"]
    assert failure["action"] == "restart" and failure["from"] == "copy", result.failures
    assert failure["redone"] < 2_000, failure  # from the start: 4,000 or more
    assert result.checkpoints == []  # copies are not the user's checkpoints
    # The copy it went on from was in memory, and is removed at the end.
    [start] = [r.getMessage().split()[4] for r in caplog.records
               if r.getMessage().startswith("generation 1 starts from ")]
    if where == "auto":
        assert start.startswith("/dev/shm/dask-train-copies-"), start
        assert not Path(start).parent.exists()
    else:
        # On the surviving worker (the killed one's copy went with it), and nowhere at the end.
        assert start.startswith("dask-train-workers://dask-train-copies-"), start
        assert not any(_files_held(own_client).values())
    _assert_every_sample_once(result, 4_000, 2)


def test_a_server_killed_before_the_first_checkpoint_goes_on_from_the_copy(
        own_client: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # checkpoint= set, its first checkpoint not due before the kill (every 10 minutes): the
    # job keeps its copies in memory until then, so the kill costs what it costs without
    # checkpoint= (the test above), not the run; the first checkpoint, at the job's end,
    # drops them.
    X, Y, validation = _data(n=4_000)
    roles = dt.start_roles(own_client, ps=1, worker=2, scorer=1)
    kill = _KillAt(own_client, roles["ps"][0], samples=4_000)
    config = dt.CheckpointConfig(str(tmp_path), every_seconds=600, keep=2)
    with dask.config.set({"dask-train.copy-every": 0.1}), \
            caplog.at_level(logging.INFO, logger="dask_train"):
        result = _trainer(own_client, Slow(mlp(8, 16, 3), 0.005), callbacks=[kill],
                          batch_size=8, checkpoint=config).fit(X, Y, validation=validation)
    assert kill.killed_at is not None
    [failure] = [f for f in result.failures if f["role"] == "ps-0"]
    assert failure["action"] == "restart" and failure["from"] == "copy", result.failures
    assert failure["redone"] < 2_000, failure  # from the start: 4,000 or more
    # The user's checkpoints: the final one only, under checkpoint='s path; no copy is left.
    assert [c.get("final") for c in result.checkpoints] == [True], result.checkpoints
    assert all(str(c["directory"]).startswith(str(tmp_path)) for c in result.checkpoints)
    [start] = [r.getMessage().split()[4] for r in caplog.records
               if r.getMessage().startswith("generation 1 starts from ")]
    assert start.startswith("/dev/shm/dask-train-copies-"), start
    assert not Path(start).parent.exists()  # dropped with the first checkpoint
    _assert_every_sample_once(result, 4_000, 2)


def test_sync_rank_killed_goes_on_from_the_survivors_state(own_client: Client, tmp_path: Path) -> None:
    # Checkpoints at steps 40 and 80, the rank killed at its 90th: the survivor's state at the
    # last step both applied is newer than either, and the job goes on from it.
    X, Y, validation = _data()
    roles = dt.start_roles(own_client, ps=0, worker=2, scorer=1)
    victim = roles["trainer"][1]
    module = _dies_at(own_client, victim, batches=90)
    config = dt.CheckpointConfig(str(tmp_path), every_seconds=None, every_steps=40, keep=3)
    result = _trainer(own_client, module, strategy="sync", checkpoint=config,
                      ).fit(X, Y, validation=validation)
    [failure] = result.failures
    assert failure["action"] == "restart" and "surviving ranks hold" in failure["reason"]
    assert failure["from"] == "survivors" and failure["redone"] == 0, failure
    assert result.generations == 2
    # Written from the survivor's memory at the step before the lost one (its 89th batch).
    [taken] = [c for c in result.checkpoints if c.get("survivors")]
    assert taken["step"] == 89, result.checkpoints
    _assert_every_sample_once(result, 12_000, 2)
    assert result.history["accuracy"].iloc[-1] > 0.85


def test_a_sync_rank_killed_without_checkpoints_loses_only_its_step(
        own_client: Client, tmp_path: Path) -> None:
    # No checkpoint= at all, and the killed rank is rank 0 (the one the scorer reads): rank 1
    # holds the same state, written to a scratch directory of this machine for the next
    # generation; nothing applied is trained again.
    X, Y, validation = _data()
    roles = dt.start_roles(own_client, ps=0, worker=2, scorer=1)
    module = _dies_at(own_client, roles["trainer"][0], batches=20)
    result = _trainer(own_client, module, strategy="sync",
                      failure=dt.FailureConfig(max_failures=3)).fit(X, Y, validation=validation)
    # Rank 0's worker also held the scorer: one loss, two records.
    [failure] = [f for f in result.failures if f["role"] != "scorer-0"]
    assert failure["role"] == "trainer-0" and failure["action"] == "restart"
    assert failure["from"] == "survivors" and failure["redone"] == 0, failure
    assert result.generations == 2
    _assert_every_sample_once(result, 12_000, 2)
    assert result.history["accuracy"].iloc[-1] > 0.85


def test_losing_a_server_beyond_max_failures_raises(own_client: Client) -> None:
    X, Y, validation = _data()
    roles = dt.start_roles(own_client, ps=1, worker=2, scorer=1)
    victim = roles["ps"][0]
    kill = _KillAt(own_client, victim, samples=4000)
    started = time.monotonic()
    with pytest.raises(dt.ParameterServerLost) as info:
        _trainer(own_client, callbacks=[kill], epochs=20,
                 failure=dt.FailureConfig(max_failures=0)).fit(X, Y, validation=validation)
    assert info.value.worker == victim and info.value.role == "ps-0"
    assert "failure 1 is more than max_failures=0" in str(info.value)
    assert time.monotonic() - kill.killed_at < 30  # type: ignore[operator]
    assert time.monotonic() - started < 120


class _EvalBomb(torch.nn.Module):
    """Trains normally; raises when scored (eval mode, a full validation batch), as a buggy
    metric would. The Trainer's up-front probe (two rows) passes."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and len(x) > 100:
            raise ValueError("boom in eval")
        return self.net(x)


def test_a_raising_scorer_is_replaced_until_max_failures(client: Client) -> None:
    X, Y, validation = _data(n=8000)
    # Epochs enough to outlast three scorer failures (a replacement takes about a second each):
    # 50 epochs took under 3 s once training got faster, and the job ended (its final score
    # raising) before the third failure was decided in a loaded full-suite run.
    trainer = dt.Trainer(_EvalBomb(), lr=1e-3, ps=1, workers=2, batch_size=16, epochs=2000,
                         score_every=0.1, timeout=30, progress=False, client=client,
                         failure=dt.FailureConfig(max_failures=2))
    started = time.monotonic()
    with pytest.raises(dt.WorkerLost) as info:
        trainer.fit(X, Y, validation=validation)
    assert "boom in eval" in str(info.value)
    assert info.value.role == "scorer-0"
    assert time.monotonic() - started < 60


def test_a_worker_killed_with_max_failures_zero_raises_naming_it(own_client: Client) -> None:
    X, Y, validation = _data()
    roles = dt.start_roles(own_client, ps=1, worker=2, scorer=1)
    victim = roles["trainer"][1]
    kill = _KillAt(own_client, victim, samples=4000)
    done = threading.Event()
    with pytest.raises(dt.WorkerLost) as info:
        _trainer(own_client, callbacks=[kill], epochs=20,
                 failure=dt.FailureConfig(max_failures=0)).fit(X, Y, validation=validation)
    done.set()
    assert info.value.worker == victim
    assert not isinstance(info.value, dt.ParameterServerLost)
    assert "max_failures=0" in str(info.value)


def _trainer_running(dask_worker) -> bool:
    return any("dt-trainer-" in str(key) for key in dask_worker.state.long_running)


class _StopAfterRejoin(dt.Callback):
    """Stops the job a few seconds after a trainer started on the restarted worker.

    A thread watches the cluster: once the nanny's new worker is back and runs a long-running
    task (a trainer secedes from the thread pool), the trainer has joined.
    """

    def __init__(self, client: Client, victim: str) -> None:
        self.kill = _KillAt(client, victim, samples=1000)
        self.before = set(live_workers(client))
        self.joined_at: float | None = None
        self.client = client
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.joined_at is None:
            time.sleep(0.2)
            new = set(live_workers(self.client)) - self.before
            if self.kill.killed_at is None or not new:
                continue
            busy = self.client.run(_trainer_running, workers=sorted(new))
            if any(busy.values()):
                self.joined_at = time.monotonic()

    def on_score(self, record):
        self.kill.on_score(record)
        return self.joined_at is not None and time.monotonic() - self.joined_at > 3


def test_a_worker_that_comes_back_replaces_the_lost_trainer(own_client: Client) -> None:
    X, Y, validation = _data()
    roles = dt.start_roles(own_client, ps=1, worker=2, scorer=1)
    victim = roles["trainer"][1]
    watch = _StopAfterRejoin(own_client, victim)
    result = _trainer(own_client, callbacks=[watch], epochs=200).fit(X, Y, validation=validation)
    assert watch.joined_at is not None, "no trainer started on the restarted worker"
    assert result.stopped_by == "callback"
    # The restarted worker (a new address) got a trainer: index 2, and it trained.
    assert len(result.roles["trainer"]) == 3
    assert result.roles["trainer"][2] not in roles.addresses
    joined = [t for t in result.trainers if t["trainer"] == 2]
    assert joined and joined[0]["samples"] > 0


class _EvalNaN(torch.nn.Module):
    """Trains normally; scores NaN (a full validation batch in eval mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(8, 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out * float("nan") if not self.training and len(x) > 100 else out


@pytest.mark.parametrize("on_nan", ["stop", "skip"])
def test_a_nan_score_stops_or_is_left_out(client: Client, on_nan: str) -> None:
    X, Y, validation = _data(n=4000)
    # Ten epochs (about a second): long enough for scores every 0.1 s while it trains. Two
    # epochs took 0.1 s, and a job that ends before its first score has only the final one,
    # after the natural end has already said why it stopped.
    result = dt.Trainer(_EvalNaN(), lr=1e-3, ps=1, workers=2, batch_size=32, epochs=10,
                        score_every=0.1, timeout=30, progress=False, client=client,
                        on_nan=on_nan).fit(X, Y, validation=validation)
    assert result.nonfinite and result.nonfinite[0]["role"] == "scorer"
    if on_nan == "stop":
        assert result.stopped_by.startswith("non-finite score")
    else:
        assert result.stopped_by == "epochs=10"
        assert result.history["loss"].notna().all()
