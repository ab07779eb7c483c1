"""The embedded cluster's workers, forked from a server that has imported torch once for all.

Dask's nannies spawn each worker as a fresh interpreter that imports distributed (0.3 s) and then,
for training, torch (0.9 s): on a 2-core machine the two workers' imports and the client's own
start-up took both cores for 1.5 s before the first step. Python's ``forkserver`` start method
imports them once, in a server process started before the scheduler, while this process starts
the scheduler and imports dask.array; each worker is then a fork of that server and starts in
0.2 s with torch already imported (the time-to-accuracy job's first step 3.8 s -> 3.0 s).

A fork server runs for the rest of the program, with the environment it was started with: a
worker forked from it does not see environment variables set in this process later. So it is used
only while this process's environment (with the nanny's ``pre-spawn-environ``) is the one the
server started with, and otherwise the workers are spawned as Dask does by default. The server
forks only while it is single-threaded: with ``OMP_NUM_THREADS=1`` (Dask's default for its
workers) importing torch starts no thread; a fork of a process whose OpenMP pool is running
can hang in the child's first parallel region.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

import dask

logger = logging.getLogger(__name__)

#: The environment the fork server was started with, once this module started it.
_server_env: dict[str, str] | None = None
_lock = threading.Lock()


def fork_workers(pre_spawn_environ: Mapping[str, Any]) -> dict[str, Any]:
    """Start the fork server if it can serve the embedded cluster; the Dask config to use it.

    Parameters
    ----------
    pre_spawn_environ : mapping
        The nannies' ``distributed.nanny.pre-spawn-environ``: set in this process's environment
        before the server starts, as each nanny sets it before it spawns a worker.

    Returns
    -------
    dict
        ``{"distributed.worker.multiprocessing-method": "forkserver"}`` to set while the cluster
        starts, or ``{}`` where the workers must be spawned (see the module's docstring): the
        config ``dask-train.fork-workers`` is false, ``distributed.worker.multiprocessing-method``
        is not its default ``spawn``, this is not Linux, ``OMP_NUM_THREADS`` is not 1, another
        part of the program started the fork server, or the environment changed since it started.
    """
    global _server_env
    if not dask.config.get("dask-train.fork-workers", True) or not sys.platform.startswith("linux"):
        return {}
    if dask.config.get("distributed.worker.multiprocessing-method") != "spawn" or \
            "forkserver" not in multiprocessing.get_all_start_methods():
        return {}
    pre_spawn = {str(k): str(v) for k, v in pre_spawn_environ.items()}
    # The nanny's own rule (Nanny.__init__), applied before the server starts: the workers must
    # share one string hash seed with those a nanny spawns later (a restart after a loss).
    if pre_spawn.get("PYTHONHASHSEED") in (None, "0"):
        pre_spawn["PYTHONHASHSEED"] = "6640"
    env = {**os.environ, **pre_spawn}
    if env.get("OMP_NUM_THREADS") != "1":
        return {}
    from multiprocessing import forkserver

    server = forkserver._forkserver  # private: the one server this process's forks go through
    with _lock:
        running = getattr(server, "_forkserver_pid", "unknown")
        if running == "unknown" or (running is not None and _server_env is None):
            return {}  # started by another part of the program: its modules, its environment
        if _server_env is not None and env != _server_env:
            logger.debug("the environment changed since the fork server started: "
                         "the embedded cluster's workers are spawned")
            return {}
        os.environ.update(pre_spawn)
        if _server_env is None:
            preload = ["distributed", "dask_train.runtime._plugin"]
            if "torch" in sys.modules:  # the program trains with torch: its workers will too
                preload.append("torch")
            preload.append("dask_train.runtime._fork_ready")
            multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
            _skip_distributed_preload()
        forkserver.ensure_running()
        _server_env = env
    return {"distributed.worker.multiprocessing-method": "forkserver"}


def _skip_distributed_preload() -> None:
    """Keep distributed from importing its preload list here and replacing ours.

    Private part touched: ``distributed.utils.get_mp_context`` imports pandas, numpy and lz4 in
    this process on its first forkserver call (0.3 s) to set them as the server's preload, and
    marks that done in ``_forkserver_preload_set``; ours is set already.
    """
    import distributed.utils

    if hasattr(distributed.utils, "_forkserver_preload_set"):
        distributed.utils._forkserver_preload_set = True
