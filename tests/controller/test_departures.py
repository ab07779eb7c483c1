"""Workers that leave with notice (``retire_workers``, ``--lifetime``) while they hold roles.

Each test retires (or lets expire) a real worker process of a real cluster in the middle of a
job, and asserts what a user is promised: the job hands the worker's roles over instead of
losing them (``result.departures``, no failure), every sample of every epoch is applied exactly
once (the ledger and the servers' count), nothing is trained again, and the log has no error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
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
from _dask_cli import dask_cli_cluster, dask_worker  # noqa: E402
from _models import Slow, mlp  # noqa: E402

ROWS, BLOCK = 12_000, 1000


@pytest.fixture()
def three_workers() -> Iterator[Client]:
    # A cluster per test: a retired worker does not come back.
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


def _data() -> tuple[Any, Any, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 3))).argmax(axis=1)
    return (da.from_array(x, chunks=(BLOCK, 8)), da.from_array(y, chunks=BLOCK),
            (x[:2000], y[:2000]))


class _RetireAt(dt.Callback):
    """Retires ``victim`` (as ``client.retire_workers`` does it for a user) once the job has
    applied ``samples`` samples."""

    def __init__(self, client: Client, victim: str, samples: int) -> None:
        self.client, self.victim, self.samples = client, victim, samples
        self.retired = False

    def on_score(self, record: Any) -> None:
        if not self.retired and record["samples"] >= self.samples:
            self.retired = True
            self.client.retire_workers([self.victim])


def _assert_every_sample_once(result: Any, epochs: int) -> None:
    per_block = result.ledger.groupby(["epoch", "block"])["consumed"].sum()
    assert result.epochs_completed == epochs
    assert len(per_block) == epochs * (ROWS // BLOCK) and (per_block == BLOCK).all()
    assert result.samples == epochs * ROWS  # the servers applied each sample once


def _summary(result: Any) -> dict[str, Any]:
    """What a failing assertion should show of a result."""
    return {"failures": result.failures, "departures": result.departures,
            "generations": result.generations, "stopped_by": result.stopped_by,
            "samples": result.samples}


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


# The server's hand-over goes through two other workers' memory, as on a cluster of several
# machines (dask-train.memory-state="workers"; the server's worker writes its shard there from
# its event loop, out of the scheduler's reach); the trainer's through /dev/shm ("auto").
@pytest.mark.parametrize(("retired", "memory"), [("ps-0", "workers"), ("trainer-1", "auto")])
def test_async_ps_hands_a_retired_workers_roles_over(three_workers: Client, retired: str,
                                                     memory: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    client = three_workers
    X, Y, validation = _data()
    roles = dt.start_roles(client, ps=1, worker=2, scorer=1)
    kind, index = retired.rsplit("-", 1)
    victim = roles[kind][int(index)]
    retire = _RetireAt(client, victim, samples=16_000)  # in the second of 6 epochs
    with caplog.at_level(logging.INFO, logger="dask_train"), \
            dask.config.set({"dask-train.memory-state": memory}):
        result = dt.Trainer(mlp(8, 16, 3), lr=1e-2, ps=1, workers=2, batch_size=32, epochs=6,
                            score_every=0.2, timeout=30, progress=False, client=client,
                            callbacks=[retire]).fit(X, Y, validation=validation)
    assert retire.retired
    assert result.failures == []
    [departure] = result.departures
    assert departure["workers"] == [victim] and retired in departure["roles"]
    assert departure["redone"] == 0 and departure["step"] > 0
    assert result.generations == 2
    _assert_every_sample_once(result, 6)
    assert victim not in result.roles.addresses  # the next generation runs on the others
    assert victim not in live_workers(client)  # and the worker did leave
    assert result.history["accuracy"].iloc[-1] > 0.85
    assert not _errors(caplog)
    assert departure["directory"].startswith(
        "dask-train-workers://" if memory == "workers" else "/dev/shm/"), departure
    held = client.run(lambda dask_worker: sorted(getattr(dask_worker, "dask_train_files", {})))
    assert not any(held.values()), held  # the hand-over's files are dropped at the end


class _StopSoonAfterRetiring(dt.Callback):
    """Retires ``victim`` once the job has applied ``samples`` samples, and stops the job at
    the first score after it left: the next generation has not yet read again the block the
    leaving trainer had partly read."""

    def __init__(self, client: Client, victim: str, samples: int) -> None:
        self.retire = _RetireAt(client, victim, samples)
        self.client, self.victim = client, victim

    def on_score(self, record: Any) -> bool:
        if not self.retire.retired:
            self.retire.on_score(record)
            return False
        return self.victim not in live_workers(self.client)


def test_a_job_stopped_right_after_a_hand_over_counts_every_row_applied(
        three_workers: Client, caplog: pytest.LogCaptureFixture) -> None:
    client = three_workers
    X, Y, validation = _data()
    roles = dt.start_roles(client, ps=1, worker=2, scorer=1)
    victim = roles["trainer"][1]
    stop = _StopSoonAfterRetiring(client, victim, samples=4_000)
    # Slow batches: a block takes over a second, so the stop comes before the block the
    # trainer left half read is read to its end again.
    result = dt.Trainer(Slow(mlp(8, 16, 3), 0.04), lr=1e-2, ps=1, workers=2, batch_size=32,
                        epochs=6, score_every=0.2, timeout=30, progress=False, client=client,
                        callbacks=[stop]).fit(X, Y, validation=validation)
    # The departure tests' own check (no cluster log: the job's is caplog's).
    _assert_handed_over(result, "", caplog)


class _RetireAsItStops(dt.Callback):
    """At the third score, retires the worker of the parameters' holder (an async-ps server,
    or a sync job's rank 0) from a thread and stops the job in the same breath: the worker
    leaves while the job stops, the moment no hand-over is made."""

    def __init__(self, client: Client, strategy: str) -> None:
        self.client, self.strategy, self.scores, self.samples = client, strategy, 0, -1

    def on_fit_start(self, info: Any) -> None:
        roles = info["roles"]
        self.victim = roles["ps"][0] if self.strategy == "async-ps" else roles["trainer"][0]

    def on_score(self, record: Any) -> bool:
        self.scores += 1
        if self.scores < 3:
            return False
        if self.samples < 0:
            self.samples = int(record["samples"])
            threading.Thread(target=self.client.retire_workers, args=([self.victim],),
                             daemon=True).start()
        return True


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_a_job_stopped_as_its_parameters_worker_retires_keeps_what_it_trained(
        three_workers: Client, strategy: str, caplog: pytest.LogCaptureFixture) -> None:
    # The stop's final pull once went through the scheduler, which no longer knew the retiring
    # worker: the async server counted as lost, the job restarted from its initial parameters
    # (no copy yet), the callback's stop was withdrawn with it and never made again, and the
    # job trained on to its 1000 epochs. Now the held worker is asked directly (async-ps), or
    # the surviving ranks give the state (sync), and the stop is made again.
    client = three_workers
    X, Y, validation = _data()
    stop = _RetireAsItStops(client, strategy)
    with caplog.at_level(logging.INFO, logger="dask_train"):
        result = dt.Trainer(mlp(8, 16, 3), lr=1e-2, strategy=strategy, workers=(1, 3),
                            batch_size=32, epochs=1000, score_every=0.2, timeout=30,
                            progress=False, client=client, callbacks=[stop],
                            ).fit(X, Y, validation=validation)
    assert not _errors(caplog), _errors(caplog)
    assert result.stopped_by == "callback" and stop.samples > 0, _summary(result)
    # The worker left with notice: no loss counted, nothing trained again, whichever came
    # first (the notice: a hand-over, then the stop; or the stop, then the notice).
    assert all(f["notice"] for f in result.failures), _summary(result)
    assert all(f.get("redone") in (None, 0) for f in result.failures), _summary(result)
    assert all(d["redone"] == 0 for d in result.departures)
    assert result.samples >= stop.samples, _summary(result)
    _assert_each_row_at_most_once(result)
    assert result.history["accuracy"].dropna().iloc[-1] > 0.8


def test_sync_regroups_on_the_survivors_when_a_rank_is_retired(
        three_workers: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    client = three_workers
    X, Y, validation = _data()
    roles = dt.start_roles(client, worker=3, scorer=1)
    victim = roles["trainer"][0]  # rank 0 holds the parameters the scorer reads
    retire = _RetireAt(client, victim, samples=16_000)
    with caplog.at_level(logging.INFO, logger="dask_train"):
        # With checkpoint=: the hand-over is one of the job's checkpoints.
        result = dt.Trainer(mlp(8, 16, 3), lr=1e-2, strategy="sync", workers=3, batch_size=32,
                            epochs=6, score_every=0.2, timeout=30, progress=False,
                            client=client, callbacks=[retire],
                            checkpoint=str(tmp_path / "ckpt")).fit(X, Y, validation=validation)
    assert retire.retired and result.failures == []
    [departure] = result.departures
    assert departure["workers"] == [victim] and "trainer-0" in departure["roles"]
    handed = [c for c in result.checkpoints if c.get("hand_over")]
    assert [c["step"] for c in handed] == [departure["step"]]
    assert len(result.roles["trainer"]) == 2  # two ranks went on
    _assert_every_sample_once(result, 6)
    assert result.history["accuracy"].iloc[-1] > 0.85
    assert not _errors(caplog)


def _kill_mid_hand_over(dask_worker: Any) -> None:
    """Run on the victim: SIGKILL this process in the middle of its hand-over, at the first
    word of the controller's after it heard the leaving notice: its answer to the notice, or
    its request that the leaving worker's trainer pause, whichever comes first. The controller
    sends both at once (the answer as a task of its own), and either may arrive first: killed
    on the answer alone, a worker under load had already paused and sent its state (the
    hand-over rightly done). Each kill runs inside the call that delivers it, not in a thread
    woken by it (a poll of the pause request, then a thread waiting for the answer, lost that
    race)."""
    from dask_train.engines.harness import control
    from dask_train.runtime._plugin import worker_state

    def die(*args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    class _Answered(threading.Event):
        def set(self) -> None:
            die()

    worker_state(dask_worker).hand_over_heard = _Answered()
    request_pause = control.request_pause

    def pause_or_die(job: str, pause_id: int, dask_worker: Any = None) -> None:
        # A pause while the worker still runs is not the hand-over's (none is asked of this
        # job before the retirement, but the kill must not come early if one is).
        if dask_worker is not None and dask_worker.status.name != "running":
            die()
        request_pause(job, pause_id, dask_worker=dask_worker)

    # Calls reach a worker by the function's name: this module's attribute is what runs here.
    control.request_pause = pause_or_die


def test_a_worker_killed_during_its_hand_over_is_a_loss(three_workers: Client,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    client = three_workers
    X, Y, validation = _data()
    roles = dt.start_roles(client, ps=1, worker=2, scorer=1)
    victim = roles["trainer"][1]
    assert victim not in roles["ps"]
    client.run(_kill_mid_hand_over, workers=[victim])
    retire = _RetireAt(client, victim, samples=16_000)
    with caplog.at_level(logging.INFO, logger="dask_train"):
        result = dt.Trainer(mlp(8, 16, 3), lr=1e-2, ps=1, workers=2, batch_size=32, epochs=6,
                            score_every=0.2, timeout=30, progress=False, client=client,
                            callbacks=[retire]).fit(X, Y, validation=validation)
    assert retire.retired and result.departures == []
    # On failure, the job's log says which way the hand-over went (this check failed once,
    # with the job cut to three epochs, and its log was not kept).
    assert any(r.getMessage().startswith(f"the hand-over from {victim} failed (WorkerLost")
               for r in caplog.records), "\n".join(r.getMessage() for r in caplog.records)
    # An async trainer lost: the survivor takes its rows (the policy's choice for a kill).
    assert [f["role"] for f in result.failures if f["role"].startswith("trainer")] == ["trainer-1"]
    _assert_every_sample_once(result, 6)


class _StopTwoScoresAfter(dt.Callback):
    """Stops the job two scores after ``happened()`` was first true at a score."""

    def __init__(self, happened: Callable[[], bool]) -> None:
        self.happened, self.after = happened, -1

    def on_score(self, record: Any) -> bool:
        if self.after < 0 and self.happened():
            self.after = 0
        elif self.after >= 0:
            self.after += 1
        return self.after >= 2


def _stop_after_departure(client: Client, workers: int,
                          leaving: subprocess.Popen[bytes]) -> _StopTwoScoresAfter:
    """Stops the job two scores after the cluster shrank to ``workers`` and the ``leaving``
    worker's process ended. Not on the shrinking alone: the scheduler forgets a retired worker
    before the worker's close holds it for the hand-over, and a stop two scores later came
    before the hand-over on a loaded machine (the job then stopped the leaving worker's roles
    with the others, and had no departure to show)."""
    return _StopTwoScoresAfter(lambda: len(live_workers(client)) <= workers and
                               leaving.poll() is not None)


def _train_until_one_left(client: Client, leaving: subprocess.Popen[bytes],
                          *callbacks: dt.Callback) -> Any:
    """An async job that runs until the cluster has two workers and ``leaving`` has ended, and
    two scores more; every worker holds a role (the one that leaves holds one too). Its batches
    take 10 ms each (a sleep, not CPU): the job trains for as long as the departure takes (a
    lifetime of 24 s, a SIGTERM'd nanny's close), whatever its rate, and a full-speed job
    spent that time on three worker processes' CPU; a score still comes about every 0.4 s."""
    client.wait_for_workers(3, timeout=30)
    X, Y, validation = _data()
    return dt.Trainer(Slow(mlp(8, 16, 3), 0.01), lr=1e-2, ps=1, workers=2, batch_size=32,
                      epochs=1000, score_every=0.2, timeout=30, progress=False, client=client,
                      callbacks=[*callbacks, _stop_after_departure(client, 2, leaving)],
                      stop=[dt.StopAfter(seconds=120)]).fit(X, Y, validation=validation)


@pytest.fixture(scope="module")
def dask_cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """``dask scheduler`` and a ``dask worker`` of two processes, started from a shell's
    programs, for the tests of a `dask worker` that leaves: each adds the worker that leaves
    (its own ``dask worker``, ended by the test) and leaves these as it found them. One for the
    module: a cluster per test started a scheduler and two worker processes (their imports,
    torch's among them) three times. Yields the address and the cluster's log."""
    directory = tmp_path_factory.mktemp("dask-cli")
    with dask_cli_cluster(directory) as (address, _):
        yield address, directory / "cluster.log"


def _cluster_log(shared: Path, tmp_path: Path) -> Callable[[], str]:
    """A reader of what the cluster logs from now on: the shared cluster's log from here (not
    the earlier tests': a SIGTERM'd worker's departure may log Dask's own ERROR there), and the
    test's own workers' (``tmp_path/cluster.log``, where :func:`dask_worker` writes)."""
    start = shared.stat().st_size

    def output() -> str:
        with shared.open("rb") as log:
            log.seek(start)
            text = log.read().decode(errors="replace")
        own = tmp_path / "cluster.log"
        return text + (own.read_text() if own.exists() else "")

    return output


def _assert_handed_over(result: Any, output: str, caplog: pytest.LogCaptureFixture, *,
                        retired: bool = True) -> None:
    # The job's own log (this process's) first: an error there says why a check below fails.
    assert not _errors(caplog), _errors(caplog)
    assert result.stopped_by == "callback", output
    assert result.failures == [], output
    [departure] = result.departures
    assert departure["redone"] == 0 and departure["step"] > 0
    consumed = result.ledger.groupby(["epoch", "block"])["consumed"].sum()
    assert (consumed <= BLOCK).all()
    # Each sample applied once. Two fresh-clone runs counted 288 and 64 samples more on the
    # servers than in the ledger: the job stopped before the next generation read again the
    # blocks the hand-over had left partly read, and the ledger's records left out the rows
    # applied before it (fixed in Ledger.records). On failure: the blocks read more than once,
    # or not to their end, and the departure.
    ledger = result.ledger
    shared = ledger.groupby(["epoch", "block"])["trainer"].transform("size") > 1
    odd = ledger[shared | (ledger["consumed"] < ledger["rows"])]
    # A string, not a tuple: pytest shortens a tuple's repr, and fc55's failure showed no row.
    assert int(consumed.sum()) == result.samples, \
        f"{departure}\n{result.trainers}\n{odd.to_string()}\n{result.ledger.to_string()}"
    if retired:
        for word in ("Traceback", "ERROR"):
            assert word not in output, output
    else:
        # Not retired, the worker left its blocks for Dask to find gone: a peer that fetched
        # one as it closed logs Dask's own "Worker stream died" ERROR (docs/cluster-changes.md).
        # No role failed, and dask-train logged no error.
        assert "Compute Failed" not in output, output
        assert not [line for line in output.splitlines()
                    if "ERROR" in line and "dask_train" in line], output


def test_a_dask_worker_whose_lifetime_ends_hands_its_roles_over(
        dask_cli: tuple[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # What dask-jobqueue recommends: `dask worker --lifetime` closes each worker before its
    # batch job's walltime (Worker.close_gracefully: retired, then closed). The lifetime must
    # end once the worker's trainer runs: 12 s ended, in a full suite on a 2-core machine, as
    # the role was still starting on the fresh workers (11 s from their start to the trainers'
    # first pause), and such a worker holds nothing, so it is a loss with notice, not a
    # hand-over (docs/cluster-changes.md).
    address, log = dask_cli
    output = _cluster_log(log, tmp_path)
    with dask_worker(address, tmp_path, "--lifetime", "24s") as leaving, \
            Client(address) as client:
        result = _train_until_one_left(client, leaving)
        text = output()  # the job's, not the leaving worker's end
    _assert_handed_over(result, text, caplog)


def _own_data_loop(ctx: Any) -> dict[str, Any]:
    """A dt.run loop that makes its own data (no Dask data on the workers: Dask's retire of
    the last workers holding data no other can take fails, and closes them without the
    hold); the state with each epoch's report. Each epoch ends with a 50 ms sleep (not CPU):
    the job runs until the workers' lifetimes end, whatever its rate, and at full speed it
    spent that time on both cores, reporting every few milliseconds."""
    import time

    import torch.nn.functional as F

    torch.manual_seed(ctx.rank)
    x = torch.randn(256, 8)
    y = (x[:, 0] > 0).long()
    model, opt, state = _model_and_state(ctx, 2)
    for epoch in ctx.epochs():
        for i in range(0, 256, 32):
            opt.zero_grad()
            F.cross_entropy(model(x[i:i + 32]), y[i:i + 32]).backward()
            opt.step()
        time.sleep(0.05)
        ctx.report({"epoch_done": float(epoch)},
                   checkpoint={"model": model.module.state_dict(), "opt": opt.state_dict(),
                               "epoch": epoch})
    return {"restored": None if state is None else state["epoch"]}


class _EndLifetimesAtReport(dt.Callback):
    """At the job's ``at``-th report, ends the lifetime of each of ``workers`` at once, as
    ``dask worker --lifetime`` ends it when it runs out (``Worker.close_gracefully(reason=
    "worker-lifetime-reached")`` called on the worker's loop)."""

    def __init__(self, client: Client, workers: Callable[[], list[str]], at: int = 2) -> None:
        self.client, self.workers, self.left = client, workers, at

    def on_score(self, record: Any) -> bool:
        async def end_lifetime(dask_worker: Any) -> None:  # nested: sent by value
            dask_worker.io_loop.add_callback(dask_worker.close_gracefully,
                                             reason="worker-lifetime-reached")

        self.left -= 1
        if self.left == 0:
            self.client.run(end_lifetime, workers=self.workers(), wait=False)
        return False


def test_dt_run_whose_every_worker_ends_its_lifetime_at_once_hands_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Both workers of one `dask worker --nworkers 2` end their lifetimes at once: no other
    # worker is left to hold the state. The lifetimes end at the job's second report, as
    # Dask's `--lifetime` ends them when it runs out: a fixed `--lifetime 24s` ended, on a slow
    # loaded machine, before the ranks' first report (their start took 30 s): they held
    # nothing, and the job started again from the beginning, with no hand-over to test (12 s
    # had ended so on a doubly loaded one). On one machine the state goes to /dev/shm and the
    # job waits for workers to join (it once gave the hand-over up: a loss, from the last
    # report's copy, or from the start when every rank held the state); two join once it says
    # it waits (a `dask worker` without a lifetime: `--lifetime-restart`'s workers end their
    # own lifetimes again, and on a loaded machine a generation started on them met the next
    # end, again and again). The single worker's test and the Slurm test run `--lifetime`
    # itself.
    with dask_cli_cluster(tmp_path) as (address, _), \
            Client(address) as client, contextlib.ExitStack() as joined:
        client.wait_for_workers(2, timeout=30)
        waits = _WhenLogged("for workers to join",  # either wait says so
                            lambda: joined.enter_context(
                                dask_worker(address, tmp_path, "--nworkers", "2")))
        with waits.watching(), caplog.at_level(logging.INFO, logger="dask_train"):
            first = set(live_workers(client))  # stop once none of them is alive
            result = dt.run(_own_data_loop, workers=(1, 2), epochs=1000, client=client,
                            callbacks=[_EndLifetimesAtReport(client, lambda: sorted(first)),
                                       _StopTwoScoresAfter(
                                           lambda: not first & set(live_workers(client)))])
        output = (tmp_path / "cluster.log").read_text()
    assert not _errors(caplog), (_errors(caplog), output)
    assert result.stopped_by == "callback" and waits.seen.is_set(), (_summary(result), output)
    # Together in one hand-over, or (their lifetimes a moment apart) one after the other, the
    # second perhaps as the next generation started: each left with notice, nothing counted
    # against max_failures, nothing trained again; and the job waited for workers to join (no
    # other was left when the hand-over was written).
    assert all(f["notice"] and f.get("redone") in (None, 0) for f in result.failures), \
        (_summary(result), output)
    assert result.departures and all(d["redone"] == 0 for d in result.departures), \
        _summary(result)
    # The ranks that ran last went on from a report's state, not from the start.
    assert None not in {r["restored"] for r in result.returns}, result.returns
    assert "dask_train" not in "".join(line for line in output.splitlines() if "ERROR" in line)


def _role_running_under(client: Client, process: subprocess.Popen[bytes]) -> int | None:
    """The pid of the worker process that ``process`` (a ``dask worker``) started, once a
    training role runs in it (None before): a role placed there may still wait behind the
    worker's data tasks on a loaded machine, and a worker with no role running holds nothing
    to hand over (one SIGTERMed so in a loaded run lost its trainer before it started)."""
    from dask_train.runtime._plugin import worker_state

    def running(dask_worker: Any) -> tuple[int, int, bool]:
        return os.getpid(), os.getppid(), worker_state(dask_worker).holding()

    for pid, parent, holding in client.run(running).values():
        if parent == process.pid and holding:
            return int(pid)
    return None


class _TerminateAt(dt.Callback):
    """Sends SIGTERM to ``process`` (as Kubernetes or a batch system does), and with
    ``whole_job`` to its worker process too (as a batch system does to every process of a job
    at its walltime, or on ``scancel``): at the third score, or the first after it at which a
    role runs in its worker."""

    def __init__(self, client: Client, process: subprocess.Popen[bytes], *,
                 whole_job: bool = False) -> None:
        self.client, self.process, self.whole_job = client, process, whole_job
        self.scores, self.sent = 0, False

    def on_score(self, record: Any) -> None:
        self.scores += 1
        if self.sent or self.scores < 3:
            return
        worker = _role_running_under(self.client, self.process)
        if worker is not None:
            self.sent = True
            for pid in (self.process.pid, worker) if self.whole_job else (self.process.pid,):
                os.kill(pid, signal.SIGTERM)


def test_a_dask_worker_sent_sigterm_hands_its_roles_over(
        dask_cli: tuple[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # SIGTERM to `dask worker` closes its nanny (10 s, then the process is killed), without
    # retiring: the worker's close still holds for the hand-over, well inside those 10 s.
    address, log = dask_cli
    output = _cluster_log(log, tmp_path)
    with dask_worker(address, tmp_path) as leaving, Client(address) as client:
        client.wait_for_workers(3, timeout=30)
        result = _train_until_one_left(client, leaving, _TerminateAt(client, leaving))
        text = output()
    _assert_handed_over(result, text, caplog, retired=False)


def test_a_dask_worker_whose_every_process_gets_sigterm_hands_its_roles_over(
        dask_cli: tuple[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The worker process gets SIGTERM beside its nanny. It once died of it at once, before the
    # nanny's close: a loss. It now closes as the nanny asks, holding for the hand-over.
    address, log = dask_cli
    output = _cluster_log(log, tmp_path)
    with dask_worker(address, tmp_path) as leaving, Client(address) as client:
        client.wait_for_workers(3, timeout=30)
        result = _train_until_one_left(client, leaving,
                                       _TerminateAt(client, leaving, whole_job=True))
        text = output()
    _assert_handed_over(result, text, caplog, retired=False)


def _model_and_state(ctx: Any, n_out: int) -> tuple[Any, Any, Any]:
    """The dt.run loops' DDP model (built from torch alone: a `dask worker` started from a
    shell cannot import the tests' helpers) and optimizer, at the last report's state if any."""
    torch.manual_seed(0)
    model = ctx.prepare(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                            torch.nn.Linear(16, n_out)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = ctx.restore()
    if state:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    return model, opt, state


def _run_loop(ctx: Any) -> dict[str, Any]:
    """A dt.run loop as a user writes one: DDP, a checkpoint with each epoch's report."""
    import torch.nn.functional as F

    model, opt, state = _model_and_state(ctx, 3)
    seen = []
    for epoch in ctx.epochs():
        for xb, yb in ctx.batches("train", batch_size=32):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
        seen.append(epoch)
        ctx.report({"epoch_done": float(epoch)},
                   checkpoint={"model": model.module.state_dict(), "opt": opt.state_dict(),
                               "epoch": epoch})
    return {"epochs": seen, "restored": None if state is None else state["epoch"]}


class _RetireAtFirstScore(dt.Callback):
    def __init__(self, client: Client, victim: str) -> None:
        self.client, self.victim, self.retired = client, victim, False

    def on_score(self, record: Any) -> None:
        if not self.retired:
            self.retired = True
            self.client.retire_workers([self.victim])


@pytest.mark.parametrize("stored", [True, False], ids=["checkpoint", "no-checkpoint"])
def test_dt_run_hands_over_at_the_next_report(three_workers: Client, tmp_path: Path,
                                              stored: bool,
                                              caplog: pytest.LogCaptureFixture) -> None:
    client = three_workers
    X, Y, _ = _data()
    victim = sorted(live_workers(client))[1]
    retire = _RetireAtFirstScore(client, victim)
    with caplog.at_level(logging.INFO, logger="dask_train"):
        result = dt.run(_run_loop, workers=(2, 3), epochs=8, client=client,
                        data={"train": (X, Y)}, callbacks=[retire],
                        checkpoint=str(tmp_path / "ck") if stored else None)
    assert not _errors(caplog), _errors(caplog)
    assert retire.retired and result.failures == []
    [departure] = result.departures
    assert departure["workers"] == [victim] and departure["redone"] == 0
    # Retired after epoch 0's report (the callback's retire call may take an epoch or two):
    # handed over at a later report, and the two others go on from the epoch after it.
    [restored] = {r["restored"] for r in result.returns}
    assert len(result.returns) == 2 and restored >= 1
    assert all(r["epochs"] == list(range(restored + 1, 8)) for r in result.returns)
    consumed = result.ledger.groupby("epoch")["consumed"].sum()
    assert consumed.to_dict() == {e: ROWS for e in range(8)}
    assert result.samples == 8 * ROWS


# -- workers that join --------------------------------------------------------------------------
@pytest.fixture()
def two_workers() -> Iterator[tuple[LocalCluster, Client]]:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield cluster, client


def _ranks_running(client: Client) -> int:
    """The job's ranks (or sync trainers) running now, as the scheduler sees their tasks."""

    def count(dask_scheduler: Any) -> int:
        return sum(1 for key, ts in dask_scheduler.tasks.items() if ts.state == "processing"
                   and str(key).startswith(("dt-rank-", "dt-trainer-")))

    return int(client.run_on_scheduler(count))


class _ScaleUpAt(dt.Callback):
    """Adds a worker to the cluster (as a user's ``cluster.scale`` does) at the first score;
    stops the job (returns True) three scores after ``n`` ranks run, whatever the load."""

    def __init__(self, cluster: LocalCluster, client: Client, n: int) -> None:
        self.cluster, self.client, self.n, self.done, self.after = cluster, client, n, False, 0

    def on_score(self, record: Any) -> bool:
        if not self.done:
            self.done = True
            self.cluster.scale(self.n)
        elif self.after or _ranks_running(self.client) == self.n:
            self.after += 1
        return self.after >= 3


class _ScaleDownThenUp(dt.Callback):
    """``cluster.scale(2)`` at the first score (Dask retires a worker: a departure), then
    ``cluster.scale(3)`` once the job runs on two ranks (a new worker joins); stops the job
    (returns True) three scores after three ranks run again, whatever the machine's load."""

    def __init__(self, cluster: LocalCluster, client: Client) -> None:
        self.cluster, self.client, self.step, self.after = cluster, client, 0, 0

    def on_score(self, record: Any) -> bool:
        if self.step == 0:
            self.step = 1
            self.cluster.scale(2)
        elif self.step == 1 and len(live_workers(self.client)) == 2 and \
                _ranks_running(self.client) == 2:
            self.step = 2
            self.cluster.scale(3)
        elif self.step == 2 and (self.after or _ranks_running(self.client) == 3):
            self.after += 1
        return self.after >= 3


def _assert_each_row_at_most_once(result: Any) -> None:
    """A job stopped mid-epoch: no block's rows consumed twice, every consumed row applied."""
    consumed = result.ledger.groupby(["epoch", "block"])["consumed"].sum()
    assert (consumed <= BLOCK).all()
    assert int(consumed.sum()) == result.samples


def test_a_sync_job_shrinks_when_scaled_down_and_grows_when_scaled_up(
        three_workers: Client) -> None:
    client = three_workers
    cluster = client.cluster
    X, Y, validation = _data()
    scaling = _ScaleDownThenUp(cluster, client)
    result = dt.Trainer(mlp(8, 16, 3), lr=1e-2, strategy="sync", workers=3, batch_size=32,
                        epochs=1000, score_every=0.2, timeout=30, progress=False, client=client,
                        callbacks=[scaling]).fit(X, Y, validation=validation)
    assert result.stopped_by == "callback" and result.failures == []
    [departure], [arrival] = result.departures, result.arrivals
    assert departure["redone"] == arrival["redone"] == 0
    assert departure["step"] <= arrival["step"] and result.generations == 3
    assert len(result.roles["trainer"]) == 3  # three ranks again from the arrival on
    _assert_each_row_at_most_once(result)


def test_dt_run_takes_in_a_worker_that_joins_at_its_next_report(
        two_workers: tuple[LocalCluster, Client]) -> None:
    cluster, client = two_workers
    X, Y, _ = _data()
    scale = _ScaleUpAt(cluster, client, 3)
    result = dt.run(_run_loop, workers=(2, 3), epochs=1000, client=client,
                    data={"train": (X, Y)}, callbacks=[scale])
    assert result.stopped_by == "callback" and result.failures == []
    [arrival] = result.arrivals
    assert arrival["redone"] == 0
    restored = {r["restored"] for r in result.returns}
    assert len(result.returns) == 3 and len(restored) == 1 and None not in restored
    _assert_each_row_at_most_once(result)


@pytest.mark.parametrize("strategy", ["sync", "async-ps"])
def test_a_trainer_with_a_range_of_workers_starts_with_those_there_are_and_grows(
        two_workers: tuple[LocalCluster, Client], strategy: str) -> None:
    # workers=(1, 3) on two workers: two trainers; a third worker joins and gets one (a sync
    # job regroups onto it, an async-ps job adopts it), nothing trained twice.
    cluster, client = two_workers
    X, Y, validation = _data()
    scale = _ScaleUpAt(cluster, client, 3)
    result = dt.Trainer(mlp(8, 16, 3), lr=1e-2, strategy=strategy, workers=(1, 3), batch_size=32,
                        epochs=1000, score_every=0.2, timeout=30, progress=False, client=client,
                        callbacks=[scale]).fit(X, Y, validation=validation)
    assert result.stopped_by == "callback" and result.failures == []
    assert len(result.roles["trainer"]) == 3
    if strategy == "sync":
        [arrival] = result.arrivals
        assert arrival["redone"] == 0 and result.generations == 2
    else:
        assert result.generations == 1 and len(result.trainers) == 3
    _assert_each_row_at_most_once(result)


def _wanted(dask_scheduler: Any) -> int:
    """The job's placeholder tasks (a worker it would take each) the scheduler holds."""
    return sum(1 for key in dask_scheduler.tasks if str(key).startswith("dt-wants-a-worker-"))


class _AdaptWhenAsked(dt.Callback):
    """At each score: the workers there are and the placeholders the scheduler holds. Makes
    the cluster adaptive once the job holds a placeholder for each worker it lacks, and stops
    the job (returns True) three scores after ``n`` trainers run with none held any more."""

    def __init__(self, cluster: LocalCluster, client: Client, n: int) -> None:
        self.cluster, self.client, self.n, self.after = cluster, client, n, 0
        self.seen: list[tuple[int, int]] = []
        self.adapting = False

    def on_score(self, record: Any) -> bool:
        workers = len(live_workers(self.client))
        wanted = int(self.client.run_on_scheduler(_wanted))
        self.seen.append((workers, wanted))
        if not self.adapting and (workers, wanted) == (1, self.n - 1):
            self.adapting = True
            self.cluster.adapt(minimum=1, maximum=self.n, interval="200ms")
        if self.after or (wanted == 0 and _ranks_running(self.client) == self.n):
            self.after += 1
        return self.after >= 3


def test_an_adaptive_cluster_grows_for_a_job_that_wants_more_workers() -> None:
    # A job with workers=(1, 3) on one worker holds a placeholder task for each worker it lacks
    # (the scheduler's adaptive target counts them); made adaptive then (so that no growth of
    # Dask's own comes first), the cluster grows to three and the job takes the new workers in.
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        X, Y, validation = _data()
        watch = _AdaptWhenAsked(cluster, client, 3)
        result = dt.Trainer(mlp(8, 16, 3), lr=1e-2, strategy="async-ps", workers=(1, 3),
                            batch_size=32, epochs=1000, score_every=0.2, timeout=30,
                            progress=False, client=client, callbacks=[watch],
                            stop=[dt.StopAfter(seconds=90)]).fit(X, Y, validation=validation)
        assert watch.adapting, watch.seen  # one worker, two asked for
        assert result.stopped_by == "callback", watch.seen  # three, none asked for any more
        assert len(result.trainers) == 3 and result.failures == []
        assert client.run_on_scheduler(_wanted) == 0  # the job's end cancels them
    _assert_each_row_at_most_once(result)


def test_dt_run_on_an_adaptive_cluster_asks_for_its_ranks_before_it_starts() -> None:
    # dt.run(workers=2) on an adaptive cluster of one worker: it waits for its second worker
    # and asks for it meanwhile, so the cluster grows and the job runs on two ranks.
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        cluster.adapt(minimum=1, maximum=2, interval="200ms")
        X, Y, _ = _data()
        result = dt.run(_run_loop, workers=2, epochs=2, timeout=60, client=client,
                        data={"train": (X, Y)})
        assert len(result.returns) == 2 and result.failures == []
        assert client.run_on_scheduler(_wanted) == 0
    consumed = result.ledger.groupby("epoch")["consumed"].sum()
    assert consumed.to_dict() == {e: ROWS for e in range(2)}


def test_a_sync_range_whose_least_the_cluster_lacks_is_refused_before_work(
        two_workers: tuple[LocalCluster, Client]) -> None:
    _, client = two_workers
    X, Y, _ = _data()
    with pytest.raises(dt.InvalidInput, match=r"workers=\(3, 4\) needs at least 3 Dask workers "
                                              r"and the cluster has 2"):
        dt.Trainer(mlp(8, 16, 3), strategy="sync", workers=(3, 4), scorer=0, progress=False,
                   client=client).fit(X, Y)


class _ScaleThenLater(dt.Callback):
    """``cluster.scale(now)`` at the first score, and ``cluster.scale(later)`` ``after`` seconds
    later from a thread (no score comes while the job waits for workers)."""

    def __init__(self, cluster: LocalCluster, now: int, later: int, after: float) -> None:
        self.cluster, self.now, self.later, self.after, self.done = cluster, now, later, after, False

    def on_score(self, record: Any) -> None:
        if not self.done:
            self.done = True
            self.cluster.scale(self.now)
            threading.Timer(self.after, self.cluster.scale, args=(self.later,)).start()


class _WhenLogged(logging.Handler):
    """Calls ``action`` from a thread the first time the dask_train log says ``text``, while
    :meth:`watching`."""

    def __init__(self, text: str, action: Callable[[], Any]) -> None:
        super().__init__()
        self.text, self.action, self.seen = text, action, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage() and not self.seen.is_set():
            self.seen.set()
            threading.Thread(target=self.action, daemon=True).start()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        log = logging.getLogger("dask_train")
        log.addHandler(self)
        try:
            yield
        finally:
            log.removeHandler(self)


class _ScaleDownThenUpWhenWaiting(dt.Callback):
    """``cluster.scale(now)`` at the first score, and ``cluster.scale(later)`` once the job
    says it waits for workers to join (``waited``, read from its log while ``watching()``).
    Not a fixed delay: a hand-over slower than it on a loaded machine saw the new worker
    before it could wait for one."""

    def __init__(self, cluster: LocalCluster, now: int, later: int) -> None:
        self.cluster, self.now, self.done = cluster, now, False
        self.log = _WhenLogged("fewer than the job needs: waiting up to",
                               lambda: cluster.scale(later))
        self.waited, self.watching = self.log.seen, self.log.watching

    def on_score(self, record: Any) -> None:
        if not self.done:
            self.done = True
            self.cluster.scale(self.now)


def test_a_job_whose_whole_cluster_is_replaced_goes_on_on_the_new_workers(
        two_workers: tuple[LocalCluster, Client], tmp_path: Path) -> None:
    # Every worker leaves at once (scale(0) at the first score, as Slurm jobs started together
    # reach their lifetime together) and two others join 2 s later. The job hands over to its
    # store when the leaving workers stay long enough (LocalCluster's close kills a worker
    # still held after 4 s, which a loaded machine reaches: then they are losses, and the job
    # restarts from its store): either way it goes on, on the new workers only. Its data
    # blocks lived on the old workers only: Dask computes them again on the new ones (they
    # once waited forever for the workers they were placed on).
    cluster, client = two_workers
    X, Y, validation = _data()
    old = set(live_workers(client))
    # 2 ms a batch: the job trains for seconds, so the cluster is replaced while it does.
    result = dt.Trainer(Slow(mlp(8, 16, 3), 0.002), lr=1e-2, strategy="async-ps", workers=(1, 2),
                        batch_size=32, epochs=2, score_every=0.2, timeout=30, progress=False,
                        client=client, failure=dt.FailureConfig(max_failures=5),
                        checkpoint=dt.CheckpointConfig(str(tmp_path), every_seconds=0.5),
                        callbacks=[_ScaleThenLater(cluster, 0, 2, after=2.0)],
                        ).fit(X, Y, validation=validation)
    assert result.generations >= 2, (result.departures, result.failures)
    assert not set(result.roles.addresses) & old  # the last generation ran on the new workers
    assert all(d["redone"] == 0 for d in result.departures)
    _assert_every_sample_once(result, 2)


def test_dt_run_below_its_least_waits_for_a_worker_to_join(
        three_workers: Client, caplog: pytest.LogCaptureFixture) -> None:
    client = three_workers
    X, Y, _ = _data()
    scaling = _ScaleDownThenUpWhenWaiting(client.cluster, 2, 3)
    with scaling.watching(), caplog.at_level(logging.INFO, logger="dask_train"):
        result = dt.run(_run_loop, workers=(3, 3), epochs=8, timeout=30, client=client,
                        data={"train": (X, Y)}, callbacks=[scaling])
    assert scaling.done and result.failures == []
    [departure] = result.departures
    assert departure["redone"] == 0
    assert scaling.waited.is_set()  # the job said it waits, and went on once a worker joined
    # No ERROR: a call to the ranks once went to the closing worker through the scheduler, which
    # waited 30 s to connect to it and logged "broadcast to ... failed" (run_on_live).
    assert not _errors(caplog), _errors(caplog)
    [restored] = {r["restored"] for r in result.returns}
    assert len(result.returns) == 3 and restored >= 1  # three ranks again, from the hand-over
    consumed = result.ledger.groupby("epoch")["consumed"].sum()
    assert consumed.to_dict() == {e: ROWS for e in range(8)}


def test_closing_an_in_process_cluster_under_a_job_is_not_held() -> None:
    # Every worker leaves at once and no hand-over can keep the job: the workers must not wait
    # out dask-train.hand-over-hold (60 s) before the cluster closes.
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                           dashboard_address=":0")
    client = Client(cluster)
    x = np.random.default_rng(0).normal(size=(4_000, 16)).astype("float32")
    ended: list[BaseException] = []

    def fit() -> None:
        try:
            dt.Trainer(torch.nn.Linear(16, 2), loss="cross_entropy", workers=2, epochs=100_000,
                       progress=False, client=client).fit(x, (x[:, 0] > 0).astype("int64"))
        except BaseException as exc:  # noqa: BLE001 - the job ends with its cluster
            ended.append(exc)

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while _ranks_running(client) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    started = time.monotonic()
    cluster.close()
    took = time.monotonic() - started
    client.close()
    thread.join(60)
    assert took < 30, took  # not held for the 60 s hold
    assert ended and not thread.is_alive()
