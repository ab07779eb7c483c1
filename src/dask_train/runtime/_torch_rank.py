"""What runs inside each rank's worker process for :func:`dask_train.start_torch`.

Each rank keeps a :class:`RankRecord` in ``worker_state().torch_groups[group_id]``; every task and
``client.run`` call here changes it under one process-wide lock, because torch's default process
group is a process-wide global that Dask's worker threads and event loop share.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from dask.utils import funcname
from distributed import get_worker

from dask_train.errors import InvalidInput
from dask_train.runtime._adopt import torch_own
from dask_train.runtime._compat import reset_torch_group_count
from dask_train.runtime._denormals import flushed
from dask_train.runtime._hosts import split_endpoint, worker_host
from dask_train.runtime._plugin import worker_state

# One lock per process, not per worker: the default process group it guards is process-wide.
_LOCK = threading.Lock()


#: What a rank says when its collective broke because a peer ended (gloo's and NCCL's words):
#: its failure is the peer's effect, not the cause (a torch group's error, a launched rank's
#: stderr).
PEER_GONE = ("Connection closed by peer", "Connection reset",
             "caused by a remote worker crashing", "NCCL communicator was aborted")

@dataclass
class RankRecord:
    """What one rank of one group keeps on its worker."""

    rank: int
    store: Any = None  # rank 0: the master TCPStore; dropping it stops the rendezvous server
    initialised: bool = False
    joined: bool = False  # the join task has run; False on a tombstone left for a late join task
    busy: int = 0  # join or run tasks of this group executing in this process now
    closing: bool = False
    broken: str = ""  # why the group was destroyed on this rank before close()


def _membership(groups: dict[str, RankRecord], address: str, exclude: str = "") -> str:
    """Why this process cannot join another group ("" when it can)."""
    import torch.distributed as dist

    for gid, st in groups.items():
        if gid != exclude and not st.closing:
            return f"worker {address} belongs to open torch group {gid!r} (rank {st.rank}): close it first."
        if gid != exclude and st.busy:
            return f"worker {address} is still leaving torch group {gid!r}: a task of it is still running."
    if dist.is_initialized() and not any(st.initialised for st in groups.values()):
        return (
            f"worker {address} already has a torch default process group that dask-train did not "
            "start: destroy it there first (torch.distributed.destroy_process_group())."
        )
    return ""


def _destroy(st: RankRecord, reason: str) -> None:
    if st.initialised:
        st.initialised, st.broken = False, reason
        torch_own("destroy_process_group")()


def gloo_interface(host: str) -> str | None:
    """The network interface that holds ``host`` (exact address first, then by subnet), or None."""
    import ipaddress

    import psutil

    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError:
            return None
    by_subnet = None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and a.netmask:
                prefix = bin(int(ipaddress.ip_address(a.netmask))).count("1")
                here = ipaddress.ip_interface(f"{a.address.split('%')[0]}/{prefix}")
                if here.ip == ip:
                    return name
                by_subnet = by_subnet or (name if ip in here.network else None)
    return by_subnet


def probe(nccl: bool, *, dask_worker: Any) -> dict[str, Any]:
    """``client.run``: which process this worker is, why it cannot join a group (and whether only
    because a task of a closed group still runs there), whether it has CUDA."""
    import torch

    with _LOCK:
        groups = worker_state(dask_worker).torch_groups
        problem = _membership(groups, dask_worker.address)
        # Only leaving, which ends by itself: within that group's timeout at the latest.
        leaving = bool(problem) and all(st.closing for st in groups.values()) and any(
            st.busy for st in groups.values())
    cuda = bool(nccl and torch.cuda.is_available())
    return {"process": f"{socket.gethostname()}:{os.getpid()}", "problem": problem,
            "leaving": leaving, "cuda": cuda}


def start_store(gid: str, world: int, timeout: float) -> str:
    """Task on rank 0: start the rendezvous store; return its ``"host:port"``."""
    from torch.distributed import TCPStore

    worker = get_worker()
    groups = worker_state(worker).torch_groups
    with _LOCK:
        if gid in groups:  # a tombstone: the start was abandoned before this task ran
            groups.pop(gid)
            return ""
        if problem := _membership(groups, worker.address):
            raise InvalidInput([problem])
        # The worker's own host, never 127.0.0.1: the other ranks may be on other machines.
        host = worker_host(worker.address)
        # Port 0: a free port chosen by the OS, so groups sharing a host never collide (a fixed port
        # such as dask-pytorch-ddp's 23456 does). wait_for_workers=False: with True the constructor
        # blocks until every rank connects, but no rank can connect before it returns the port.
        delta = timedelta(seconds=timeout)
        store = TCPStore(host, 0, world, is_master=True, wait_for_workers=False, timeout=delta)
        groups[gid] = RankRecord(rank=0, store=store)
    return f"{host}:{store.port}"


def rank_device(kind: str, chosen: str | None) -> str | None:
    """The device a rank trains on: None on CPUs; under NCCL, the GPU its group's start gave it
    (:func:`join`); else (gloo, ranks sharing GPUs) ``chosen``, the one chosen for its worker,
    made the current device so that the user's code finds it there too."""
    if kind != "cuda":
        return None
    import torch
    import torch.distributed as dist

    if (dist.is_initialized() and dist.get_backend() == "nccl") or not chosen or ":" not in chosen:
        return f"cuda:{torch.cuda.current_device()}"
    torch.cuda.set_device(torch.device(chosen))
    return chosen


def join(gid: str, rank: int, world: int, master: str, backend: str, timeout: float,
         local_rank: int = 0) -> bool:
    """Task on every rank: ``init_process_group``; False when the start was abandoned meanwhile.

    ``local_rank`` is the rank's index among the ranks on its host; with nccl it picks the GPU.
    """
    import torch.distributed as dist

    worker = get_worker()
    groups = worker_state(worker).torch_groups
    with _LOCK:
        st = groups.get(gid)
        if (st is not None and st.closing) or (rank == 0 and st is None):
            # The start was abandoned before this task ran: do not join (and block on) a dead group.
            groups.pop(gid, None)
            return False
        if problem := _membership(groups, worker.address, exclude=gid):
            raise InvalidInput([problem])
        st = groups.setdefault(gid, RankRecord(rank=rank))
        st.busy += 1
        # A failed init_process_group leaves torch's group counter raised: see _compat.
        reset_torch_group_count()
    # Every wait gets the group's timeout: a vanished host sends no reset, so without one a rank
    # would wait for its peers for torch's default 30 minutes.
    delta = timedelta(seconds=timeout)
    ok = False
    try:
        store = st.store
        if store is None:
            host, port = split_endpoint(master)
            store = dist.TCPStore(host, port, world, is_master=False, timeout=delta)
        if not _check_in(store, world, st, timeout):
            return False  # abandoned meanwhile (leave): the finally below ends the record
        # gloo binds the address the machine's host name resolves to, often a loopback one (127.0.1.1
        # on Debian) that peers on other hosts cannot reach; the interface Dask reaches this worker
        # on is reachable by construction. A GLOO_SOCKET_IFNAME set by the user wins; ours is set
        # only while the group is created (when gloo reads it), so user code never inherits it.
        iface = gloo_interface(worker_host(worker.address)) if backend == "gloo" else None
        env = {"GLOO_SOCKET_IFNAME": iface} if iface and "GLOO_SOCKET_IFNAME" not in os.environ else {}
        os.environ.update(env)
        if backend == "nccl":
            import torch

            # NCCL refuses two ranks on one GPU: ranks sharing a host take one GPU each.
            torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))
        try:
            # gloo's worker threads, which sum the ranks' gradients, are made here and inherit
            # this thread's FTZ/DAZ flags for the group's life (see runtime._denormals).
            with flushed():
                torch_own("init_process_group")(backend, store=store, rank=rank,
                                                world_size=world, timeout=delta)
        finally:
            for name in env:
                os.environ.pop(name, None)
        ok = True
    finally:
        with _LOCK:
            st.busy -= 1
            st.joined, st.initialised = True, ok
            if st.closing:  # torn down while this rank was joining: leave at once
                _destroy(st, "the group's start was abandoned")
                ok = False
                if not st.busy:
                    groups.pop(gid, None)
            elif not ok:  # failed: the teardown that follows (leave) removes the record
                st.closing, st.store = True, None
    return ok


#: The rendezvous store's count of the ranks that checked in (:func:`_check_in`).
_ARRIVED = "dask-train/arrived"


def _check_in(store: Any, world: int, st: RankRecord, timeout: float) -> bool:
    """Count this rank in on the group's store and wait for the others; False as soon as the
    group's start is abandoned (:func:`leave` marks it closing).

    Why: ``init_process_group`` waits for a peer that never comes (its worker left as the
    group started) for the whole timeout and cannot be interrupted; the worker stayed "still
    leaving" that group meanwhile, and the job's next generation could not place a rank there.
    Here the wait is short polls of the count; ``init_process_group`` then runs with every
    rank present. Raises TimeoutError after ``timeout`` seconds, as the rendezvous would.
    """
    arrived = store.add(_ARRIVED, 1)
    deadline = time.monotonic() + timeout
    pause = 0.002
    while arrived < world:
        if st.closing:
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"{world - arrived} of {world} ranks did not join within "
                               f"{timeout:g} s")
        time.sleep(pause)
        pause = min(0.05, pause * 2)
        arrived = store.add(_ARRIVED, 0)
    return True


def leave(gid: str, tombstone: bool, *, dask_worker: Any) -> tuple[int, bool]:
    """``client.run``: destroy the group here.

    Returns how many of its tasks still run here, and whether this rank's join task had started.
    With ``tombstone``, a record is left where there was none, so that a join task of this group
    that starts later (it was queued when the start was abandoned) returns at once. The record of a
    join task that Dask cancelled before it ran stays: a few bytes per failed start.
    """
    groups = worker_state(dask_worker).torch_groups
    with _LOCK:
        if gid not in groups and not tombstone:
            return 0, True
        st = groups.setdefault(gid, RankRecord(rank=-1))
        st.closing, st.store = True, None
        _destroy(st, "the group was closed")
        if st.joined and not st.busy:
            groups.pop(gid, None)
        return st.busy, st.joined or st.busy > 0


def call_on_rank(gid: str, rank: int, fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Task on every rank: ``fn(*args, **kwargs)`` inside the group."""
    import torch.distributed as dist

    worker = get_worker()
    groups = worker_state(worker).torch_groups
    with _LOCK:
        st = groups.get(gid)
        if st is None or not st.initialised or not dist.is_initialized():
            why = (st and st.broken) or "the group was closed, or this worker restarted"
            raise RuntimeError(
                f"torch group {gid!r} is not initialised in this process (rank {rank} on "
                f"{worker.address}): {why}. Close the group and start a new one with dt.start_torch."
            )
        st.busy += 1
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:
        # Destroying closes this rank's connections, so peers blocked in a collective with it fail at
        # once ("Connection closed by peer") instead of waiting for the group's timeout.
        with _LOCK:
            _destroy(st, f"destroyed after {type(exc).__name__} in {funcname(fn)} on this rank")
        raise
    finally:
        with _LOCK:
            st.busy -= 1
            if st.closing and not st.busy:
                groups.pop(gid, None)
