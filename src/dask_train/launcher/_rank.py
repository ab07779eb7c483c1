"""Worker side of ``dt.launch``: one rank's task runs the user's program in a child process,
as ``python script.py args`` would, and streams its output to the client.

A child process, not the worker's own interpreter: the program gets ``__name__ == "__main__"``,
its own ``sys.argv``, ``sys.path`` and working directory, signals (SIGTERM on notice, Ctrl-C's
stop) and a process of its own for ``torch.distributed``'s default group, which it initialises
and destroys itself; the worker is left as it was, whatever the program does or how it ends.
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from distributed import get_worker

from dask_train.runtime._hosts import worker_host
from dask_train.runtime._plugin import worker_state
from dask_train.runtime._ports import free_port
from dask_train.runtime._torch_rank import PEER_GONE

logger = logging.getLogger(__name__)

#: How often a rank sends its program's output to the client: live to the eye, and one event
#: per interval whatever the number of lines (a Dask event costs a scheduler message).
FLUSH_S = 0.05
#: Most output lines in one event (a program that prints in a tight loop).
LINES_PER_EVENT = 2000

_PR_SET_PDEATHSIG = 1
_CHILDREN: dict[tuple[str, int], _Child] = {}
_CHILDREN_LOCK = threading.Lock()
#: Run -> the newest attempt stopped here (forgotten at the run's end, :func:`forget_run`).
_STOPPED: dict[str, int] = {}


@dataclass(frozen=True)
class Program:
    """What every rank runs: ``python [-m] target args`` in ``cwd`` (a path on the workers),
    or, with ``bundle``, in the bundle unpacked on each worker (``target`` then relative to it)."""

    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    cwd: str = ""
    bundle: bytes | None = None
    env: dict[str, str] = field(default_factory=dict)

    def argv(self, root: str) -> list[str]:
        """The child's command line, its script under ``root`` when the program travelled."""
        if self.module:
            return [sys.executable, "-m", self.target, *self.args]
        script = self.target if not self.bundle else str(Path(root) / self.target)
        return [sys.executable, script, *self.args]


class _Child:
    """A rank's running program and how it is to end."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.signalled = ""  # "SIGTERM" once the launcher asked it to stop

    def stop(self, grace: float) -> None:
        """SIGTERM now, SIGKILL after ``grace`` seconds if it is still running."""
        if self.proc.poll() is not None:
            return
        self.signalled = self.signalled or "SIGTERM"
        _signal(self.proc, signal.SIGTERM)

        def escalate() -> None:
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal(self.proc, signal.SIGKILL)

        threading.Thread(target=escalate, name="dask-train-launch-stop", daemon=True).start()


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    """``sig`` to the program and every process it started (its own session)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


_PRCTL: Any = None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the worker's thread that started it dies (a
    killed worker must not leave the program running, holding its port and its peers).
    ``prctl`` is looked up before the fork (:func:`_prctl`): loading a library in the child of
    a threaded process can deadlock on a lock another thread held at the fork."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _prctl() -> Any:
    """libc's ``prctl`` (Linux), None elsewhere."""
    global _PRCTL
    if _PRCTL is None and sys.platform.startswith("linux"):
        _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
    return _PRCTL


def master_port(*, dask_worker: Any) -> int:
    """``client.run`` on rank 0's worker: a free port on its host for the program's
    ``env://`` rendezvous (``MASTER_PORT``), as torchrun's agent picks one."""
    return free_port(worker_host(dask_worker.address))


def stop_ranks(run_id: str, attempt: int, grace: float, *, dask_worker: Any = None) -> int:
    """``client.run``: SIGTERM to this worker's programs of ``run_id`` up to ``attempt``,
    SIGKILL after ``grace`` seconds; how many there were. A rank of those attempts whose task
    starts later (it was queued) does not start its program."""
    with _CHILDREN_LOCK:
        _STOPPED[run_id] = max(attempt, _STOPPED.get(run_id, -1))
        children = [c for (run, n), c in _CHILDREN.items() if run == run_id and n <= attempt]
    for child in children:
        child.stop(grace)
    return len(children)


def forget_run(run_id: str, *, dask_worker: Any = None) -> None:
    """``client.run`` at a run's end: nothing of it is kept here."""
    with _CHILDREN_LOCK:
        _STOPPED.pop(run_id, None)


def running_children(run_id: str = "", *, dask_worker: Any = None) -> list[int]:
    """``client.run``: the pids of programs of ``run_id`` (any run with "") still alive here."""
    with _CHILDREN_LOCK:
        return [c.proc.pid for (run, _), c in _CHILDREN.items()
                if (not run_id or run == run_id) and c.proc.poll() is None]


def _unpacked(bundle: bytes, *, run_id: str) -> str:
    """The program's directory, unpacked once per worker and run into the worker's own local
    directory (Dask removes it with the worker); kept across the run's restarts so that what
    the program wrote there (a snapshot) is there again."""
    root = Path(get_worker().local_directory) / "dask-train-launch" / run_id
    done = root / ".unpacked"
    if not done.exists():
        root.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(io.BytesIO(bundle)) as archive:
            archive.extractall(root)
        done.touch()
    return str(root)


def launch_rank(program: Program, env: dict[str, str], *, run_id: str, rank: int,
                attempt: int, topic: str) -> dict[str, Any]:
    """Dask task: rank ``rank`` of attempt ``attempt``; its exit code, once the program ended.

    The output goes to the client on event ``topic`` as ``{"rank", "attempt", "lines":
    [[stream, text], ...]}`` every :data:`FLUSH_S`, then ``{"rank", "attempt", "exit": code}``.
    While the program runs the worker counts a role running, so a worker leaving with notice
    announces itself to the run (``dask-train-<run_id>``) and waits for it to stop the program.
    """
    from distributed import secede

    worker = get_worker()
    state = worker_state(worker)
    state.job(run_id)
    with state.role_running():
        secede()  # a rank waits on its program for the whole run: not on a pool thread
        root = _unpacked(program.bundle, run_id=run_id) if program.bundle else program.cwd
        child_env = {**os.environ, **program.env, **env}
        child_env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the user as printed
        host = worker_host(worker.address)
        iface = _gloo_interface(host)
        if iface and "GLOO_SOCKET_IFNAME" not in child_env:
            child_env["GLOO_SOCKET_IFNAME"] = iface
        started = time.time()
        _prctl()
        # start_new_session: the terminal's Ctrl-C reaches the launcher, which stops every rank
        # (a LocalCluster's workers share the terminal's process group); the program and what
        # it starts are one process group to signal.
        with _CHILDREN_LOCK:  # one lock with stop_ranks: a stop never misses a program
            if _STOPPED.get(run_id, -1) >= attempt:
                state.drop(run_id)
                return {"rank": rank, "attempt": attempt, "exit": -signal.SIGTERM,
                        "worker": worker.address, "pid": None, "signalled": "not started",
                        "seconds": 0.0}
            proc = subprocess.Popen(program.argv(root), cwd=root or None, env=child_env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True,
                                    preexec_fn=_die_with_parent)
            child = _Child(proc)
            _CHILDREN[(run_id, attempt)] = child
        try:
            code, peer_gone = _relay(proc, worker=worker, topic=topic, rank=rank,
                                     attempt=attempt)
            ended = time.time()
        finally:
            if proc.poll() is None:
                _signal(proc, signal.SIGKILL)
                proc.wait()
            with _CHILDREN_LOCK:
                _CHILDREN.pop((run_id, attempt), None)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            state.drop(run_id)
    worker.log_event(topic, {"rank": rank, "attempt": attempt, "exit": code})
    # ``ended`` and ``peer_gone`` let the launcher name the rank that failed first for its
    # own reason (a peer that aborted on the closed connection may end, and answer, sooner).
    return {"rank": rank, "attempt": attempt, "exit": code, "worker": worker.address,
            "pid": proc.pid, "signalled": child.signalled, "seconds": ended - started,
            "ended": ended, "peer_gone": peer_gone}


def _gloo_interface(host: str) -> str | None:
    from dask_train.runtime._torch_rank import gloo_interface

    try:
        return gloo_interface(host)
    except Exception:  # noqa: BLE001 - psutil missing or an odd interface: gloo's own choice
        return None


def _relay(proc: subprocess.Popen[bytes], *, worker: Any, topic: str, rank: int,
           attempt: int) -> tuple[int, bool]:
    """Send the program's output lines until both its streams close; its exit code, and
    whether its stderr said a peer's connection closed (:data:`PEER_GONE`)."""
    lines: queue.Queue[tuple[str, str] | None] = queue.Queue()

    def read(stream: IO[bytes], name: str) -> None:
        for raw in iter(stream.readline, b""):
            lines.put((name, raw.decode("utf-8", "replace").rstrip("\n")))
        lines.put(None)

    readers = [threading.Thread(target=read, args=(s, n), daemon=True,
                                name=f"dask-train-launch-{n}")
               for s, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for reader in readers:
        reader.start()
    open_streams, peer_gone = len(readers), False
    while open_streams:
        batch: list[list[str]] = []
        deadline = time.monotonic() + FLUSH_S
        while open_streams and len(batch) < LINES_PER_EVENT:
            try:
                item = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                open_streams -= 1
            else:
                batch.append(list(item))
                if item[0] == "stderr" and not peer_gone:
                    peer_gone = any(words in item[1] for words in PEER_GONE)
        if batch:
            worker.log_event(topic, {"rank": rank, "attempt": attempt, "lines": batch})
    for reader in readers:
        reader.join()
    return int(proc.wait()), peer_gone
