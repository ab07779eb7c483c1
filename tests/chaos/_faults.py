"""Ways to SIGKILL a Dask worker at a chosen moment of a job, for the fault tests.

Every kill is a real ``SIGKILL`` of a real worker process (its nanny starts a new one). The
moments are found from outside the job, through what a user could also see: the scheduler's
tasks (which worker runs a trainer or the scorer), the controller's own events on the job's topic
(``dask-train-<job_id>``: roles, failures, new generations), or, for a moment too short to see
from the client (a checkpoint file half written, a pause just asked for), a watcher thread inside
the victim's own process that kills it the instant the moment comes.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dask
from distributed import Client, LocalCluster

import dask_train as dt
from dask_train.data._cluster import live_workers


@contextmanager
def killable_cluster(n_workers: int = 2) -> Iterator[Client]:
    """A LocalCluster of worker processes (nannies restart the killed ones) and its client.

    LocalCluster forgets a nanny for good when, ``distributed.deploy.lost-worker-timeout``
    (15 s) after its worker died, no worker of that name is registered: a worker killed again
    and restarting at that moment never came back (1 run in 3 of these tests lost a worker
    so). Real clusters' nannies have no such check; here it is put off past any test.
    """
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "1h"}), \
            LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                         dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


def pid_of(client: Client, address: str) -> int:
    """The process id of the Dask worker at ``address``."""
    return int(client.run(os.getpid, workers=[address])[address])


def alive(client: Client) -> set[str]:
    """The workers the scheduler knows now."""
    return set(live_workers(client))


def kill(client: Client, address: str, *, timeout: float = 30.0) -> None:
    """SIGKILL the worker at ``address`` (its nanny restarts it on a new port); returns once
    the scheduler has removed it (about 15 ms; until then it still looks alive, and a call to
    it waits for the 30 s connect timeout)."""
    os.kill(pid_of(client, address), signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while address in alive(client) and time.monotonic() < deadline:
        time.sleep(0.01)


def wait_for_workers(client: Client, n: int, *, timeout: float = 60.0) -> None:
    """Wait until ``n`` workers are alive (a nanny brings a killed one back in 1-7 s)."""
    client.wait_for_workers(n, timeout=timeout)


# -- where the roles are ---------------------------------------------------------------------
def _processing(dask_scheduler: Any) -> dict[str, list[str]]:
    """Run on the scheduler: key -> the worker running it, for the roles' long-running tasks."""
    running: dict[str, list[str]] = {}
    for key, ts in dask_scheduler.tasks.items():
        name = str(key)
        if ts.state == "processing" and ts.processing_on is not None and name.startswith("dt-"):
            running.setdefault(name, []).append(ts.processing_on.address)
    return running


class JobWatch:
    """The controller's events of the one job on a cluster, read from the scheduler.

    Parameters
    ----------
    client : distributed.Client
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self.topic = ""
        self.before = self._jobs()  # earlier jobs' topics: the one to watch is the next

    def _jobs(self) -> set[str]:
        topics = self.client.run_on_scheduler(
            lambda dask_scheduler: [str(t) for t in dask_scheduler.get_events()])
        return {t for t in topics if t.startswith("dask-train-") and "-g" not in t[11:]}

    def _find_topic(self) -> str:
        if not self.topic:
            new = sorted(self._jobs() - self.before)
            self.topic = new[0] if new else ""
        return self.topic

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The controller's events so far (of ``kind``), oldest first."""
        topic = self._find_topic()
        if not topic:
            return []
        events = [msg for _, msg in self.client.get_events(topic)]
        return [e for e in events if kind is None or e.get("kind") == kind]

    def roles(self) -> dict[str, list[str]]:
        """Where each kind of role runs now: ``trainer``, ``scorer`` (the tasks running),
        ``server`` (an async job's parameter servers, or a sync job's rank 0)."""
        placed = [e["roles"] for e in self.events() if e.get("kind") in ("start", "generation")]
        running = self.client.run_on_scheduler(_processing)
        now: dict[str, list[str]] = {"trainer": [], "scorer": [], "server": []}
        for key, where in sorted(running.items()):
            if key.startswith("dt-trainer-"):
                now["trainer"] += where
            elif key.startswith("dt-scorer"):
                now["scorer"] += where
        servers = placed[-1].get("ps", []) if placed else []
        if not servers:  # sync: rank 0 holds the parameters
            servers = [w for key, where in running.items() if key.startswith("dt-trainer-0-")
                       for w in where]
        now["server"] = list(servers)
        return {kind: sorted(set(a)) for kind, a in now.items()}

    def wait(self, ready: Callable[[], bool], *, timeout: float, every: float = 0.02) -> bool:
        """Poll ``ready()`` until it is true (True) or ``timeout`` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return True
            time.sleep(every)
        return False


# -- watchers inside the victim's process ----------------------------------------------------
#: How long a watcher stays armed: one whose moment never came must not kill a later test's
#: worker on the same cluster.
_ARMED_S = 90.0


def _kill_self(marker: str, note: str, still: Callable[[], bool] = lambda: True) -> None:
    # The marker tells the test what the process saw when it died: written, then the kill.
    # ``still`` looks at the moment again after the marker's write, which lets other threads
    # run: a moment gone by then is no kill (the marker is taken back).
    Path(marker).write_text(note)
    if still():
        os.kill(os.getpid(), signal.SIGKILL)
    Path(marker).unlink()


def _watch_writes(root: str, marker: str, after: int) -> None:
    """Kill this process once a shard file is being written under ``root`` while ``after``
    complete checkpoints (manifests) exist."""
    base, deadline = Path(root), time.monotonic() + _ARMED_S
    while time.monotonic() < deadline:
        try:
            dirs = [d for d in base.iterdir() if d.is_dir()] if base.exists() else []
            complete = [d for d in dirs if (d / "manifest.json").exists()]
            writing = [d / f for d in dirs if d not in complete for f in os.listdir(d)
                       if ".tmp-" in f and f.startswith("shard-")]
        except OSError:  # a directory pruned while we looked
            continue
        if len(complete) >= after and writing:
            # Dead while the file is still half written: a fresh-clone run's kill came after
            # the marker's write let the holder finish the shard and the checkpoint completed
            # (the job rightly went on from it). A file finished by then is the next
            # checkpoint's chance.
            _kill_self(marker, str(writing[0]), still=writing[0].exists)
        time.sleep(0.0002)


def kill_while_writing(client: Client, address: str, root: str, marker: str, *,
                       after: int = 1) -> None:
    """Arm the worker at ``address`` to die while it writes a checkpoint shard under ``root``
    (once ``after`` checkpoints are complete). ``marker`` receives the half-written file's path."""

    def arm(dask_worker: Any = None) -> None:
        threading.Thread(target=_watch_writes, args=(root, marker, after), daemon=True).start()

    client.run(arm, workers=[address])


def kill_at_pause(client: Client, address: str, marker: str, *, pause_id: int) -> None:
    """Arm the worker at ``address`` to die as soon as the controller asks its trainers to pause
    for checkpoint ``pause_id`` (or a later one), before they have paused."""

    def arm(dask_worker: Any = None) -> None:
        threading.Thread(target=_watch_pauses, args=(dask_worker, marker, pause_id),
                         daemon=True).start()

    client.run(arm, workers=[address])


def _watch_pauses(dask_worker: Any, marker: str, pause_id: int) -> None:
    from dask_train.runtime._plugin import worker_state

    state, deadline = worker_state(dask_worker), time.monotonic() + _ARMED_S
    while time.monotonic() < deadline:
        for job, held in list(state.jobs.items()):
            if held.pause_id >= pause_id:
                _kill_self(marker, f"{job} pause {held.pause_id}")
        time.sleep(0.0002)


def running_trainers(client: Client) -> dict[str, list[str]]:
    """Workers running a trainer (of any job: a search's trials too), as ``{"trainer": [...]}``,
    or a ``dt.run`` job's rank (as ``{"rank": [...]}``)."""
    running = client.run_on_scheduler(_processing)

    def holding(prefix: str) -> list[str]:
        return sorted({w for key, where in running.items() if key.startswith(prefix)
                       for w in where})

    return {"trainer": holding("dt-trainer-"), "rank": holding("dt-rank-")}


def retire(client: Client, address: str, *, timeout: float = 60.0) -> None:
    """Scale the cluster down by the worker at ``address``, as an adaptive cluster does
    (``SpecCluster.scale_down``: Dask retires it, and the job hands its roles over), then back to
    its size: a new worker joins. Returns once the retired worker has gone."""
    cluster = client.cluster
    assert cluster is not None, "a retire needs the client's own cluster"
    size = len(cluster.worker_spec)
    name = live_workers(client)[address]["name"]
    cluster.sync(cluster.scale_down, [name])
    deadline = time.monotonic() + timeout
    while address in alive(client) and time.monotonic() < deadline:
        time.sleep(0.05)
    cluster.scale(size)


class Schedule(dt.Callback):
    """A seeded schedule of SIGKILLs (and retirements: ``actions``) during one fit, or the fits
    of a search (one at a time).

    Kill ``i`` comes at a random share of the work (drawn from ``windows[i]``: the shares of
    ``fits`` fits of ``planned`` samples each; a fit restarted from an earlier checkpoint goes
    back and reaches it again), then a random delay of up to half a second, and hits a worker
    holding a role of a random kind, all drawn from ``random.Random(seed)``. Each kill waits
    for the cluster to be whole again (the nanny's new worker) and for a score after the one
    before, so every kill meets a job that is running. Used as the job's callback: the scores
    tell it the work done.

    Parameters
    ----------
    client : distributed.Client
    seed : int
    kinds : list of str
        One kind of role per kill, in an order drawn from the seed.
    roles : callable
        ``roles()`` -> kind -> addresses of the workers holding such a role now.
    planned : float
        Samples one fit trains (epochs * rows).
    workers : int
        The cluster's size.
    fits : int
    actions : list of str, optional
        ``"kill"`` (the default for each event) or ``"retire"`` (:func:`retire`: a departure
        with notice, then a worker that joins), one per event, in an order drawn from the seed.
    """

    def __init__(self, client: Client, *, seed: int, kinds: list[str],
                 roles: Callable[[], Mapping[str, list[str]]], planned: float, workers: int,
                 fits: int = 1, windows: tuple[tuple[float, float], ...] = (
                     (0.1, 0.2), (0.3, 0.45), (0.5, 0.65)),
                 actions: list[str] | None = None) -> None:
        rng = random.Random(seed)
        kinds = rng.sample(kinds, len(kinds))
        self.plan = [(rng.uniform(lo, hi), rng.uniform(0.0, 0.5), kind, rng.random())
                     for (lo, hi), kind in zip(windows, kinds)]
        actions = actions or ["kill"] * len(self.plan)
        # Drawn after the rest: a schedule of kills only is the one it always was.
        self.actions = rng.sample(actions, len(actions)) if "retire" in actions else actions
        self.retired: list[dict[str, Any]] = []
        self.client, self.roles, self.planned, self.fits = client, roles, planned, fits
        self.workers = workers
        self.started = self.scores = 0
        self.progress = 0.0
        self.kills: list[dict[str, Any]] = []
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="chaos")

    def on_fit_start(self, info: Mapping[str, Any]) -> None:
        self.started += 1
        self.progress = (self.started - 1) / self.fits
        if not self.thread.is_alive() and not self.kills:
            self.thread.start()

    def on_score(self, record: Mapping[str, Any]) -> None:
        share = min(1.0, float(record.get("samples", 0)) / self.planned)
        self.progress = (self.started - 1 + share) / self.fits
        self.scores += 1

    def stop(self) -> None:
        """End the schedule (the job ended); waits for its thread."""
        self.ended.set()
        if self.thread.is_alive():
            self.thread.join(timeout=70)

    def _due(self, share: float, scores: int) -> bool:
        if self.ended.is_set() or self.progress < share or self.scores <= scores:
            return False
        return len(alive(self.client)) >= self.workers

    def _run(self) -> None:
        scores = 0
        for (share, delay, kind, pick), action in zip(self.plan, self.actions):
            while not self._due(share, scores):
                if self.ended.wait(0.05):
                    return
            time.sleep(delay)
            while not self._strike(kind, pick, action):
                if self.ended.wait(0.05):
                    return
            scores = self.scores

    def _strike(self, kind: str, pick: float, action: str) -> bool:
        """Kill (or retire) a worker holding a ``kind`` role now; False when none does (a
        generation starting) or it died meanwhile."""
        holders = sorted(set(self.roles().get(kind, [])) & alive(self.client))
        if not holders:
            return False
        address = holders[int(pick * len(holders))]
        record = {"kind": kind, "worker": address, "progress": self.progress}
        try:
            if action == "retire":
                retire(self.client, address)
                self.retired.append(record)
                return True
            kill(self.client, address)
        except Exception:  # gone between the two looks: pick again
            return False
        self.kills.append(record)
        return True


def summary(result: Any) -> Mapping[str, Any]:
    """What a failing assertion should show of a result."""
    return {"failures": result.failures, "generations": result.generations,
            "stopped_by": result.stopped_by, "checkpoints": [c["directory"] for c in
                                                              result.checkpoints]}
