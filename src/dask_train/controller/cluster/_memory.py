"""Where a job keeps state in memory, and that state's stores: a directory of this machine's
``/dev/shm`` when every worker of the job runs on it (:func:`memory_dir`), else files kept by two
live workers (:mod:`dask_train.runtime._worker_files`). The place is the policy's
(:func:`~dask_train.policy._copies.memory_place`); this module reads the cluster (the workers'
hosts, this machine's addresses) and makes, re-holds and drops the stores. Used for a job's
in-memory copies (:mod:`.._keeping`) and its hand-over scratch (:mod:`._departures`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from dask_train.checkpoint import CheckpointConfig
from dask_train.controller._checkpointing import Checkpoints
from dask_train.policy._copies import MemoryPlace, memory_place, on_one_machine
from dask_train.runtime._hosts import worker_hosts
from dask_train.runtime._processes import remove_orphans
from dask_train.runtime._worker_files import PROTOCOL, holders_for, register_protocol, remove
from dask_train.runtime._worker_files import url as worker_files_url

logger = logging.getLogger(__name__)

_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def on_this_machine(addresses: Iterable[str]) -> bool:
    """Whether every worker address is on this machine (a directory here is theirs too)."""
    return on_one_machine(worker_hosts(addresses), _local_addresses())


#: What a job keeps in memory (:func:`memory_store`'s ``kind``): its in-memory copies, and its
#: hand-over scratch store.
COPIES, HAND_OVER = "dask-train-copies-", "dask-train-hand-over-"
#: The prefixes of the directories :func:`memory_dir` makes, which :func:`sweep_memory_dirs` sweeps.
MEMORY_DIRS = (COPIES, HAND_OVER)


def memory_dir(prefix: str) -> str:
    """A new directory in this machine's memory (``/dev/shm``, else the temporary directory),
    for state every worker of this machine reads and writes, and no worker's death takes.

    Its name carries this process's id (``<prefix>p<pid>-<random>``): the job drops it at its
    end, but a client killed first cannot, so those of processes that are gone are swept here
    (:func:`sweep_memory_dirs`), as the parameter servers' segments are.
    """
    where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    sweep_memory_dirs(where)
    return tempfile.mkdtemp(prefix=f"{prefix}p{os.getpid()}-", dir=where)


def sweep_memory_dirs(where: str) -> int:
    """Remove the directories of :func:`memory_dir` in ``where`` whose process is gone; the
    number removed."""
    def owner(name: str) -> int | None:
        pid = re.search(r"-p(\d+)-[^-]+$", name)
        return int(pid.group(1)) if pid and os.path.isdir(os.path.join(where, name)) else None

    removed = remove_orphans(where, MEMORY_DIRS, owner=owner, remove=shutil.rmtree)
    if removed:
        logger.info("removed %d directories of state kept in memory by processes that are gone",
                    removed)
    return removed


def memory_place_of(memory_state: str, workers: Iterable[str]) -> MemoryPlace:
    """Where state kept in memory for ``workers`` goes
    (:func:`~dask_train.policy._copies.memory_place`, over their hosts and this machine's)."""
    return memory_place(memory_state, hosts=worker_hosts(workers), here=_local_addresses())


def memory_store(kind: str, job_id: str, *, workers: Iterable[str], alive: Iterable[str],
                 timeout: float, memory_state: str, **config: Any) -> Checkpoints | None:
    """A store for a job's state of ``kind`` (:data:`COPIES` or :data:`HAND_OVER`) kept in
    memory, that no single worker's death takes (where:
    :func:`memory_place_of`, ``memory_state`` being
    :data:`~dask_train.policy._copies.MEMORY_STATE`'s). In the workers' memory, each file is
    kept by two live workers (:func:`~dask_train.runtime._worker_files.holders_for`: workers
    without a role first). None: in the workers' memory, with no live worker."""
    workers, prefix = list(workers), f"{kind}{job_id}-"
    if memory_place_of(memory_state, workers) is MemoryPlace.MACHINE:
        return Checkpoints(CheckpointConfig(path=memory_dir(prefix), **config), timeout=timeout)
    register_protocol()
    holders = holders_for(alive, roles=workers)
    if not holders:
        return None
    path = worker_files_url(prefix + uuid.uuid4().hex[:8])
    return Checkpoints(CheckpointConfig(path=path, storage_options={"holders": holders},
                                        **config), timeout=timeout)


def in_workers(store: Checkpoints | None) -> bool:
    """Whether ``store`` keeps its files in the workers' memory."""
    return store is not None and os.fspath(store.config.path).startswith(PROTOCOL + "://")


def rehold(store: Checkpoints, *, alive: Iterable[str], workers: Iterable[str]) -> Checkpoints:
    """``store`` with live holders: those of its holders still ``alive`` first (they keep the
    files written so far), topped up from the others. A directory store as it is."""
    if not in_workers(store):
        return store
    options = dict(store.config.storage_options or {})
    holders = holders_for(alive, roles=workers, keep=options.get("holders", ()))
    if not holders or holders == list(options.get("holders", ())):
        return store
    options["holders"] = holders
    return Checkpoints(replace(store.config, storage_options=options), timeout=store.timeout)


def drop_store(store: Checkpoints) -> None:
    """Remove a store of :func:`memory_store` with every file in it (holders gone are
    skipped)."""
    if in_workers(store):
        with contextlib.suppress(Exception):
            remove(os.fspath(store.config.path), (store.config.storage_options or {})["holders"])
    else:
        shutil.rmtree(store.config.path, ignore_errors=True)


def _local_addresses() -> set[str]:
    """Every address of this machine: the host name's, and each network interface's (workers
    often listen on the interface that reaches the scheduler, say eth0's, which is not the
    address the host name resolves to)."""
    import psutil  # a dependency of distributed

    here = set(_LOOPBACK)
    try:
        here.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    for entries in psutil.net_if_addrs().values():
        here |= {e.address.split("%", 1)[0] for e in entries
                 if e.family in (socket.AF_INET, socket.AF_INET6)}
    return here
