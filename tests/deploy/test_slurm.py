"""dask-train on dask-jobqueue's ``SLURMCluster``, against a real one-node Slurm (``_slurm.py``).

The workers are Slurm batch jobs. In the first test they run ``dask worker --lifetime ...
--lifetime-restart``, as dask-jobqueue recommends for jobs that must end before their walltime:
each worker closes with notice when its lifetime ends (and its nanny starts a new one in the
same job) while a dask-train job trains on it. In the second, a batch job reaches its walltime:
Slurm sends SIGTERM to each of its processes, the worker process too. What a user is promised
in both: the worker's roles are handed over (a record in ``result.departures``, not a failure),
no sample is applied twice, and training goes on.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt
from dask_train.data._cluster import live_workers

sys.path.insert(0, str(Path(__file__).parents[1] / "engines"))
sys.path.insert(0, str(Path(__file__).parent))
from _models import Slow  # noqa: E402
from _slurm import slurm, slurm_available  # noqa: E402

ROWS, BLOCK = 12_000, 1000
# Seconds, --lifetime-stagger 1s. The first worker's lifetime must end once its trainer runs: it
# starts STAGGER s before the second Slurm job's worker, the job starts once that one is there,
# and its trainers took up to 11 s to start under a full suite's load on a 2-core machine. At
# 20 s a fresh-clone run's first worker left before its trainer ran (nothing to hand over: a
# loss with notice, no departure).
LIFETIME = 30
# Seconds between the two jobs' starts, so that one worker leaves (and is back) at a time and the
# job always has a worker to hand over to. Both leaving together (two jobs started at once) left
# none for 2-3 s, and the generation started on the restarted workers trained nothing: its data
# blocks were in Dask's no-worker state (see the report of issue 38).
STAGGER = 10


@pytest.fixture(scope="module")
def slurm_conf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A one-node Slurm for this module; ``SLURM_CONF`` names it while it runs."""
    reason = slurm_available()
    if reason is not None:
        pytest.skip(reason)
    with slurm(tmp_path_factory.mktemp("slurm")) as conf:
        yield conf


class _StopWhenBack(dt.Callback):
    """Stops the job two scores after a worker of the start has left and one that was not
    there has joined (the first worker's lifetime ended and its nanny started the next one).
    Not on the cluster having two workers again: Dask's nanny sometimes ends instead of
    starting the next worker (the retired worker's heartbeat found the scheduler unaware of it:
    "worker-heartbeat-missing"), and that job's worker never came back."""

    def __init__(self, client: Client) -> None:
        self.client, self.after = client, -1
        self.first = set(live_workers(client))

    def on_score(self, record: Any) -> bool:
        workers = set(live_workers(self.client))
        if self.after < 0 and workers - self.first and self.first - workers:
            self.after = 0
        elif self.after >= 0:
            self.after += 1
        return self.after >= 2


def _logs(caplog: pytest.LogCaptureFixture, directory: Path) -> str:
    """The job's log here and each Slurm job's (its workers'), for an assertion's message."""
    return "--- this process\n" + caplog.text + "".join(
        f"--- {p.name}\n{p.read_text()}" for p in sorted(directory.glob("*.err")))


def _job() -> tuple[Any, Any, tuple[np.ndarray, np.ndarray], torch.nn.Module]:
    """The training data (a dask array, its targets, a held-out part) and the network."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 3))).argmax(1)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return (da.from_array(x, chunks=(BLOCK, 8)), da.from_array(y, chunks=BLOCK),
            (x[:2000], y[:2000]), net)


def _slurm_cluster(directory: Path, *, walltime: str, worker_extra_args: list[str]) -> Any:
    """dask-jobqueue's ``SLURMCluster`` of one-worker jobs, logging to ``directory``.

    Its import sets its own SIGINT handler (sys.exit: Ctrl-C then raises SystemExit, not
    KeyboardInterrupt), for the whole process: the previous one is put back, or every later
    test of Ctrl-C in this process fails."""
    previous = signal.getsignal(signal.SIGINT)
    from dask_jobqueue import SLURMCluster

    signal.signal(signal.SIGINT, previous)
    return SLURMCluster(cores=1, processes=1, memory="2GB", walltime=walltime,
                        python=sys.executable, worker_extra_args=worker_extra_args,
                        local_directory=str(directory), log_directory=str(directory),
                        # dask-train's own INFO lines (a hand-over's) in the workers' logs
                        job_script_prologue=["export DASK_LOGGING__DASK_TRAIN=info"],
                        scheduler_options={"dashboard_address": ":0"})


def _fit(client: Client, directory: Path, callback: dt.Callback, seconds: float) -> Any:
    """An async-ps job on one or two workers, until ``callback`` stops it (or ``seconds``).
    Its batches take 10 ms each (a sleep, not CPU): the job trains until a worker's lifetime
    or its batch job's walltime ends (30-60 s), whatever its rate, and at full speed it spent
    that time on both cores; a score still comes every 0.5 s."""
    X, Y, validation, net = _job()
    return dt.Trainer(Slow(net, 0.01), strategy="async-ps", ps=1, workers=(1, 2), scorer=1, lr=1e-2,
                      batch_size=32, epochs=1000, score_every=0.5, timeout=60, progress=False,
                      client=client, callbacks=[callback],
                      # the hand-over writes the state here: on a real Slurm the workers are
                      # on other hosts, where no scratch directory of this machine reaches
                      checkpoint=str(directory / "checkpoints"),
                      stop=[dt.StopAfter(seconds=seconds)]).fit(X, Y, validation=validation)


def _assert_handed_over(result: Any, caplog: pytest.LogCaptureFixture, logs: str) -> None:
    """A departure (no loss but one with notice as the job stops), nothing trained again,
    training went on after it, each sample applied once, and no error logged."""
    assert result.stopped_by == "callback", logs
    # A worker whose lifetime ends while the job stops (the second Slurm job's, once the first
    # one's restart and the stop took longer than STAGGER: 10 s for the nanny to start the next
    # worker and 5 s for the stop, on a loaded 2-core machine) is handed nothing, as documented
    # (docs/cluster-changes.md): a loss with notice, not counted against max_failures.
    assert all(f["notice"] and f["loss"] is None for f in result.failures), \
        f"failures: {result.failures}\n{logs}"
    assert result.departures and all(d["redone"] == 0 for d in result.departures), logs
    # Trained on: a score of a step past the one the state was handed over at. (Not "more
    # samples than the scores before the departure": on a slow machine a worker may leave
    # before the first score, and then there is none before it.)
    handed_over_at = result.departures[0]["step"]
    when = f"departures: {result.departures}\nhistory:\n" + \
        result.history[["time_s", "step", "samples"]].to_string() + "\n"
    assert result.history["step"].max() > handed_over_at, when + logs
    consumed = result.ledger.groupby(["epoch", "block"])["consumed"].sum()
    assert (consumed <= BLOCK).all(), logs
    assert int(consumed.sum()) == result.samples, logs  # each sample applied once
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert errors == [], logs
    assert not [line for line in logs.splitlines() if "ERROR" in line and "dask_train" in line], logs


# Slurm's least walltime is a minute, and it looks for jobs past their time limit every 30 s:
# the walltime test's first batch job ends 60-90 s after it starts. It is submitted when the
# module's first test starts, so that its minute runs during the lifetime test (30 s) rather
# than after it.
@pytest.fixture(scope="module")
def walltime_cluster(slurm_conf: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[tuple[Any, Path, float]]:
    """A ``SLURMCluster`` of one-minute jobs without ``--lifetime``, its first job submitted;
    with the directory of its logs and the ``time.monotonic()`` of the submission."""
    directory = tmp_path_factory.mktemp("walltime")
    with _slurm_cluster(directory, walltime="00:01:00", worker_extra_args=[]) as cluster:
        cluster.scale(jobs=1)
        yield cluster, directory, time.monotonic()


@pytest.mark.usefixtures("walltime_cluster")  # its first job's minute runs meanwhile
def test_slurm_workers_whose_lifetime_ends_hand_their_roles_over(
        slurm_conf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lifetime = ["--lifetime", f"{LIFETIME}s", "--lifetime-stagger", "1s", "--lifetime-restart"]
    with _slurm_cluster(tmp_path, walltime="00:05:00", worker_extra_args=lifetime) as cluster:
        # Two jobs STAGGER seconds apart, as a queue starts them: the first worker leaves and
        # comes back while the second one holds the job.
        cluster.scale(jobs=1)
        # Connected as docs/deploy.md does: dask-train's plugin (it preloads torch) is on every
        # worker from its start, a restarted one's too.
        with dt.connect(cluster.scheduler_address, quiet=True) as client:
            client.wait_for_workers(1, timeout=60)
            time.sleep(STAGGER)
            cluster.scale(jobs=2)
            client.wait_for_workers(2, timeout=60)
            with caplog.at_level(logging.INFO, logger="dask_train"):
                result = _fit(client, tmp_path, _StopWhenBack(client), seconds=60)
    _assert_handed_over(result, caplog, _logs(caplog, tmp_path))


class _StopWhenGone(dt.Callback):
    """Stops the job two scores after every worker that was there when it was made has left
    (and another one runs)."""

    def __init__(self, client: Client) -> None:
        self.client, self.after = client, -1
        self.first = set(live_workers(client))

    def on_score(self, record: Any) -> bool:
        workers = set(live_workers(self.client))
        if self.after < 0 and workers and not workers & self.first:
            self.after = 0
        elif self.after >= 0:
            self.after += 1
        return self.after >= 2


# Slurm looks for jobs past their time limit every 30 s: jobs started this far apart reach it
# at different looks, one at a time.
WALLTIME_APART = 35
# The latest, in seconds after the first job's submission, that the walltime test may start on
# it: the second job is then submitted at once, and joins (a worker's start, seconds) before
# the first one's minute is up.
LATEST_START = 45


def test_a_slurm_job_that_reaches_its_walltime_hands_its_roles_over(
        walltime_cluster: tuple[Any, Path, float], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # No --lifetime: at the walltime (one minute, Slurm's least) Slurm sends SIGTERM to the
    # batch job's processes, and SIGKILL KillWait (5 s here, 30 s by default) later. The
    # worker process once died of the SIGTERM at once: the job lost its roles.
    cluster, directory, submitted = walltime_cluster
    if time.monotonic() - submitted > LATEST_START:
        # The lifetime test took long (a loaded machine): the second job could join after the
        # first one's end. A fresh cluster, as when this test runs alone.
        cluster.close()
        cluster = _slurm_cluster(tmp_path, walltime="00:01:00", worker_extra_args=[])
        cluster.scale(jobs=1)
        directory, submitted = tmp_path, time.monotonic()
    with cluster, dt.connect(cluster.scheduler_address, quiet=True) as client:
        client.wait_for_workers(1, timeout=60)
        watch = _StopWhenGone(client)  # the first job's worker (the second is submitted below)
        later = threading.Timer(max(0.0, WALLTIME_APART - (time.monotonic() - submitted)),
                                cluster.scale, kwargs={"jobs": 2})
        later.start()
        try:
            with caplog.at_level(logging.INFO, logger="dask_train"):
                result = _fit(client, directory, watch, seconds=150)
        finally:
            later.cancel()
    logs = _logs(caplog, directory)
    assert "DUE TO TIME LIMIT" in logs, logs  # the walltime ended the first batch job
    assert "got SIGTERM while it serves" in logs, logs
    assert not set(result.roles.addresses) & watch.first, logs  # it went on on the second job
    _assert_handed_over(result, caplog, logs)
