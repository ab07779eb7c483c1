"""A cluster started as a user starts one from a shell: ``dask scheduler`` and ``dask worker``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

#: Seconds a ``dask worker`` process may take to exit on SIGTERM. A fresh-clone run saw one
#: without a nanny still running 30 s after it: its main thread in ``asyncio.run``'s cancelling
#: of the remaining tasks, its one other thread idle, its log at "Removing Worker plugin
#: dask-train" of ``Worker.close`` (no job or role left on it). The wait after that point that
#: Dask bounds by its 30 s close timeout is the batched stream's close, which waits for its
#: sender to say it stopped; a sender whose write was cancelled with every other task ends
#: without saying so (``batched.py``; the close timeouts of dask/distributed#7318). Eight
#: SIGTERMs of a worker flooding its stream exited within 0.2 s here, so that reading is not
#: confirmed. A worker still running after Dask's own bound and some room is stuck for another
#: reason, and fails with its stacks.
EXIT_S = 60.0


def scheduler_address(info: Path, *, timeout: float = 30.0) -> str:
    """The address ``dask scheduler --scheduler-file info`` writes, once the file is whole: it
    exists a moment before its text is written (an empty read failed a run under load)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return str(json.loads(info.read_text())["address"])
        except (FileNotFoundError, ValueError, KeyError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no scheduler address in {info} after {timeout:g} s") \
                    from None
            time.sleep(0.05)


def _worker_command(address: str, *options: str) -> list[str]:
    return [str(Path(sys.executable).parent / "dask"), "worker", address, *options,
            "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"]


#: The workers' environment: dask-train's own INFO lines (a hold for a hand-over, or why none
#: was made) in the cluster's log, which a failed check prints.
_WORKER_ENV = {**os.environ, "DASK_LOGGING__DASK_TRAIN": "info"}


def _end(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
        process.wait(EXIT_S)


@contextmanager
def dask_cli_cluster(tmp_path: Path, *more: list[str], first: Sequence[str] = ()
                     ) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    """``dask scheduler``, a ``dask worker`` of two processes (with options ``first`` besides),
    and one more ``dask worker`` per option list in ``more``, from this environment; every
    process logs to ``tmp_path/cluster.log``. Yields the scheduler's address and the extra
    workers' processes. Workers are stopped before the scheduler (SIGTERM), for a quiet end."""
    info = tmp_path / "scheduler.json"
    # Appended to: a worker started later (dask_worker) writes to the same file.
    log = (tmp_path / "cluster.log").open("a")
    scheduler = subprocess.Popen([str(Path(sys.executable).parent / "dask"), "scheduler",
                                  "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                  "--scheduler-file", str(info)], stdout=log, stderr=log)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        address = scheduler_address(info)
        for options in (["--nworkers", "2", *first], *more):
            workers.append(subprocess.Popen(_worker_command(address, *options),
                                            stdout=log, stderr=log, env=_WORKER_ENV))
        yield address, workers[1:]
    finally:
        _end([*workers, scheduler])
        log.close()


@contextmanager
def dask_worker(address: str, tmp_path: Path, *options: str
                ) -> Iterator[subprocess.Popen[bytes]]:
    """One more ``dask worker`` for the cluster of :func:`dask_cli_cluster` (same log),
    stopped (SIGTERM) on exit: enter it before, or within, that cluster's block."""
    with (tmp_path / "cluster.log").open("a") as log:
        worker = subprocess.Popen(_worker_command(address, *options), stdout=log, stderr=log,
                                  env=_WORKER_ENV)
        try:
            yield worker
        finally:
            _end([worker])
