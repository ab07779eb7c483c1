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
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from distributed import Client


def pid_of(client: Client, address: str) -> int:
    """The process id of the Dask worker at ``address``."""
    return int(client.run(os.getpid, workers=[address])[address])


def kill(client: Client, address: str) -> None:
    """SIGKILL the worker at ``address`` (its nanny restarts it on a new port)."""
    os.kill(pid_of(client, address), signal.SIGKILL)


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

    def _find_topic(self) -> str:
        if not self.topic:
            topics = self.client.run_on_scheduler(
                lambda dask_scheduler: [str(t) for t in dask_scheduler.get_events()])
            jobs = [t for t in topics if t.startswith("dask-train-") and "-g" not in t[11:]]
            if jobs:
                self.topic = sorted(jobs)[-1]
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
            if key.startswith("dt-worker-"):
                now["trainer"] += where
            elif key.startswith("dt-scorer"):
                now["scorer"] += where
        servers = placed[-1].get("ps", []) if placed else []
        if not servers:  # sync: rank 0 holds the parameters
            servers = [w for key, where in running.items() if key.startswith("dt-worker-0-")
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
def _kill_self(marker: str, note: str) -> None:
    # The marker tells the test what the process saw when it died: written, then the kill.
    Path(marker).write_text(note)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch_writes(root: str, marker: str, after: int) -> None:
    """Kill this process once a shard file is being written under ``root`` while ``after``
    complete checkpoints (manifests) exist."""
    base = Path(root)
    while True:
        dirs = [d for d in base.iterdir() if d.is_dir()] if base.exists() else []
        complete = [d for d in dirs if (d / "manifest.json").exists()]
        if len(complete) >= after:
            for d in dirs:
                if d in complete:
                    continue
                for f in os.listdir(d):
                    if ".tmp-" in f and f.startswith("shard-"):
                        _kill_self(marker, str(d / f))
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

    state = worker_state(dask_worker)
    while True:
        for job, held in list(state.jobs.items()):
            if held.pause_id >= pause_id:
                _kill_self(marker, f"{job} pause {held.pause_id}")
        time.sleep(0.0002)


def summary(result: Any) -> Mapping[str, Any]:
    """What a failing assertion should show of a result."""
    return {"failures": result.failures, "generations": result.generations,
            "stopped_by": result.stopped_by, "checkpoints": [c["directory"] for c in
                                                              result.checkpoints]}
