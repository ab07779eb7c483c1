"""``start_torch``: a torch.distributed process group stood up inside Dask worker processes.

Rank 0's worker hosts the rendezvous (a ``TCPStore`` on a free port of its own address); every rank
joins with ``init_process_group`` in a task pinned to its worker; :class:`TorchGroup` then runs a
function on every rank inside that group. torch's default group is a per-process global, so each rank
needs its own worker process, and a process belongs to one group at a time. The code that runs in the
workers is in ``_torch_rank.py``.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from typing import Any, Literal

from dask.utils import funcname
from distributed import Client, Future, as_completed

from dask_train.errors import InvalidInput, TrainingTimeout, WorkerLost
from dask_train.runtime._calls import live_workers, run_on_live
from dask_train.runtime._hosts import local_ranks
from dask_train.runtime._torch_rank import (
    PEER_GONE,
    call_on_rank,
    join,
    leave,
    probe,
    start_store,
)

BACKENDS = ("gloo", "nccl")

#: The longest wait for the other ranks' tasks to end after a start that lost a rank's worker.
LOST_SETTLE_S = 2.0


def _pin(address: str) -> dict[str, Any]:
    # The default group lives in one process: a rank's task anywhere else would find no group.
    # pure=False: these tasks change process-global state and must run every time they are submitted.
    return {"workers": [address], "allow_other_workers": False, "pure": False}


def _outcome(fut: Future) -> BaseException:
    """A copy of the exception of a failed future, with the remote traceback Dask keeps.

    A copy, because raising the exception the client stores would attach the caller's frames to it,
    and those frames hold the futures: the client would never release them (``Future.result()``
    leaks so).
    """
    if fut.status == "cancelled":
        return CancelledError(f"task {fut.key} was cancelled")
    exc = fut.exception()
    assert exc is not None
    try:
        exc = copy.copy(exc)  # it came through pickle, so it can be rebuilt the same way
    except Exception:  # pragma: no cover - an exception type that cannot be rebuilt: raise it as is
        pass
    return exc.with_traceback(fut.traceback())


def _collateral(exc: BaseException) -> bool:
    """An error a rank got because a peer failed (gloo reports a closed connection as RuntimeError)."""
    import torch.distributed as dist

    markers = ("gloo", "NCCL", *PEER_GONE)
    return isinstance(exc, (dist.DistError, ConnectionError, CancelledError)) or (
        isinstance(exc, RuntimeError) and any(m in str(exc) for m in markers)
    )


def _leave_all(
    client: Client, gid: str, addresses: Sequence[str], *, settle: float = 0.0, tombstone: bool = False
) -> dict[str, bool]:
    """Destroy the group on its ranks; wait up to ``settle`` s for its tasks to end there.

    Returns, per worker, whether its rank's join task had started.
    """
    # Only workers still in the cluster, a closing one by a direct call: a broadcast to a lost
    # one waits for the connect timeout (run_on_live).
    answers = client.sync(run_on_live, client, leave, gid, tombstone, workers=list(addresses))
    answers = {a: b for a, b in answers.items() if isinstance(b, tuple)}
    # A rank blocked in a collective fails within milliseconds once its peers are destroyed, and a
    # rank blocked joining within its own timeout; waiting for them leaves the workers free for the
    # next group instead of "still leaving". A rank busy computing cannot be interrupted: give up.
    deadline = time.monotonic() + settle
    busy = [a for a, (n, _) in answers.items() if n]
    while busy and time.monotonic() < deadline:
        time.sleep(0.05)
        again = client.sync(run_on_live, client, leave, gid, False, workers=busy)
        busy = [a for a, b in again.items() if isinstance(b, tuple) and b[0]]
    return {a: started for a, (_, started) in answers.items()}


class TorchGroup:
    """A torch.distributed default process group, one rank per Dask worker process.

    Made by :func:`start_torch`; a context manager that closes the group.

    Attributes
    ----------
    id : str
        Group id, also in the keys of its tasks.
    ranks : dict of int to str
        Rank -> Dask worker address.
    master : str
        ``"host:port"`` of the rendezvous store on rank 0's worker.
    backend : str
    timeout : float
        Seconds for joining, for collectives and for :meth:`gather`.
    closed : bool

    Examples
    --------
    >>> def total(x):                                           # doctest: +SKIP
    ...     t = torch.tensor([x]); torch.distributed.all_reduce(t); return t.item()
    >>> with dt.start_torch(client, workers=2) as group:        # doctest: +SKIP
    ...     group.gather(group.run(total, 1.0))
    [2.0, 2.0]
    """

    def __init__(
        self, *, client: Client, group_id: str, ranks: dict[int, str], master: str, backend: str,
        timeout: float,
    ) -> None:
        self.client, self.id, self.ranks, self.master = client, group_id, ranks, master
        self.backend, self.timeout = backend, timeout
        self.closed = False
        self._futures: list[Future] = []

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Future]:
        """Call ``fn(*args, **kwargs)`` on every rank inside the group; one future per rank, in order.

        ``torch.distributed.get_rank()`` tells ``fn`` its rank. If ``fn`` raises on a rank, that
        rank destroys its process group first, so peers waiting in a collective fail at once.
        """
        if self.closed:
            raise RuntimeError(f"torch group {self.id!r} is closed: start a new one with dt.start_torch.")
        token = uuid.uuid4().hex[:8]
        futures = [
            self.client.submit(
                call_on_rank, self.id, rank, fn, list(args), kwargs,
                key=f"{funcname(fn)}-{self.id}-rank{rank}-{token}", **_pin(addr),
            )
            for rank, addr in self.ranks.items()
        ]
        self._futures = [f for f in self._futures if not f.done()] + futures
        return futures

    def gather(
        self, futures: Sequence[Future], *, timeout: float | Literal["group"] | None = "group"
    ) -> list[Any]:
        """Wait for the futures of :meth:`run`; their results in rank order.

        On an error the group is closed on every rank and the original exception of ``fn`` is
        re-raised, even when peers failed after it with collateral connection errors.

        Parameters
        ----------
        futures : list of Future
            As returned by :meth:`run`.
        timeout : float, "group" or None
            Seconds to wait; "group" (default): the group's timeout; None: no limit (long runs).
            Past it the group is closed and :class:`TrainingTimeout` names the ranks still running.
        """
        futures = list(futures)
        limit = self.timeout if timeout == "group" else timeout
        failed: list[Future] = []
        try:
            # The group's own client's loop: without loop=, as_completed waits through the
            # process's default client, which may be another one or none at all.
            for fut in as_completed(futures, loop=self.client.loop, timeout=limit):
                if fut.status == "finished":
                    continue
                if not failed:
                    # Destroy the group everywhere now: ranks blocked in a collective with the failed
                    # one fail in milliseconds, so every rank's outcome arrives soon.
                    _leave_all(self.client, self.id, list(self.ranks.values()))
                failed.append(fut)
        except TimeoutError:
            late = [f"rank {r} on {self.ranks[r]}" for r, f in enumerate(futures) if not f.done()]
            self.close()
            raise TrainingTimeout(
                f"{', '.join(late)} did not finish within {limit} s; the group was closed."
            ) from None
        if not failed:
            return [f.result() for f in futures]
        errors = [_outcome(f) for f in failed]
        self.close()
        # The user's exception, not the "Connection closed by peer" its peers got because of it.
        raise next((e for e in errors if not _collateral(e)), errors[0])

    def close(self) -> None:
        """Destroy the process group on every rank; the workers can then join a new group."""
        pending = [f for f in self._futures if not f.done()]
        if pending:
            self.client.cancel(pending)
        _leave_all(self.client, self.id, list(self.ranks.values()), settle=min(self.timeout, 10.0))
        self._futures, self.closed = [], True

    def __enter__(self) -> TorchGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"TorchGroup({self.id!r}, {self.backend}, ranks={self.ranks}, master={self.master!r}, {state})"


def start_torch(
    client: Client, workers: int | Sequence[str], *, backend: str = "gloo", timeout: float = 60.0
) -> TorchGroup:
    """Start a torch.distributed process group with one rank in each of some Dask worker processes.

    Parameters
    ----------
    client : distributed.Client
    workers : int or list of str
        A number of ranks (the least-loaded worker processes not already in a group, address order
        on ties), or worker addresses in rank order.
    backend : {"gloo", "nccl"}
        "nccl" needs CUDA on every chosen worker. Each rank then uses the GPU given by its
        position among the ranks on its host (``torch.cuda.set_device``), modulo the GPUs it
        sees: one GPU each for several workers on a multi-GPU host, and device 0 for workers
        that see one GPU each (``CUDA_VISIBLE_DEVICES``, as dask-cuda sets it).
    timeout : float
        Seconds every rank has to join; also the group's timeout for collectives and :meth:`gather`,
        and the longest wait for a chosen worker still leaving a closed group (a task of that group
        still running there, such as a join blocked on a lost peer, which ends within its group's
        timeout).

    Returns
    -------
    TorchGroup

    Raises
    ------
    InvalidInput
        Every problem with the arguments or the chosen workers, before anything is submitted (a
        worker still leaving a closed group: once ``timeout`` has passed).
    TrainingTimeout
        A rank did not join within ``timeout``; the ranks that had started are torn down.
    WorkerLost
        A chosen worker died while the ranks were placed or joined.

    Examples
    --------
    >>> group = dt.start_torch(client, workers=2, backend="gloo", timeout=60)   # doctest: +SKIP
    >>> group.ranks, group.master                                               # doctest: +SKIP
    ({0: 'tcp://10.0.0.5:40233', 1: 'tcp://10.0.0.6:41877'}, '10.0.0.5:53411')
    """
    problems = _check_args(workers=workers, backend=backend, timeout=timeout)
    addrs: list[str] = []
    if not problems:
        addrs, problems = _place_when_free(client=client, workers=workers,
                                           nccl=backend == "nccl", timeout=timeout)
    if problems:
        raise InvalidInput(problems)
    gid, world, ranks = f"torch-{uuid.uuid4().hex[:8]}", len(addrs), dict(enumerate(addrs))
    # The master address comes back as this task's result, not through a Variable: the client needs
    # it anyway to submit the other ranks' joins, and a named Variable costs another scheduler round
    # trip and must be deleted afterwards.
    store = client.submit(start_store, gid, world, timeout, key=f"torch-store-{gid}", **_pin(addrs[0]))
    (master,) = _await_all(client, gid, ranks, [store], "start the rendezvous store", timeout)
    local = local_ranks(addrs)
    joins = [
        client.submit(
            join, gid, rank, world, master, backend, timeout, local[rank],
            key=f"torch-join-{gid}-rank{rank}", **_pin(addr),
        )
        for rank, addr in ranks.items()
    ]
    _await_all(client, gid, ranks, joins, "join the torch group", timeout)
    return TorchGroup(
        client=client, group_id=gid, ranks=ranks, master=master, backend=backend, timeout=timeout
    )


def _await_all(
    client: Client, gid: str, ranks: dict[int, str], futures: list[Future], what: str, timeout: float
) -> list[Any]:
    """Results of one task per rank; on a failure, a rank's worker lost, or past ``timeout``,
    tear down and raise (:class:`WorkerLost` for a lost worker)."""
    failed, lost = _wait_ranks(client, ranks, futures, timeout)
    late = {r: a for r, a in ranks.items() if r < len(futures) and not futures[r].done()}
    if failed is None and not late:
        results, lost, late = _results(client, ranks, futures, timeout)
        if not (lost or late):
            return results
    client.cancel([f for f in futures if not f.done()])  # queued joins must not start a dead group
    # The others' joins waiting for a lost rank end within 50 ms of the leave (_check_in): a
    # next group started on their workers at once finds them free.
    started = _leave_all(client, gid, [ranks[r] for r in range(len(futures))],
                         settle=min(timeout, LOST_SETTLE_S) if lost else timeout, tombstone=True)
    if lost:
        rank, address = lost[0]
        raise WorkerLost(f"rank {rank}'s worker {address} left the cluster while the ranks tried "
                         f"to {what}", worker=address, role=f"trainer-{rank}")
    # The missing ranks are those whose task never started; the others were waiting for them.
    missing = {r: a for r, a in late.items() if not started.get(a, False)}
    why = "its task never started: a busy or lost worker" if missing else "can the ranks reach each other?"
    text = str(failed).lower()
    if late and (failed is None or isinstance(failed, TimeoutError) or "timeout" in text):
        who = ", ".join(f"rank {r} on {a}" for r, a in (missing or late).items())
        raise TrainingTimeout(
            f"{who} did not {what} within {timeout:g} s ({why}); the ranks that had started were torn "
            "down."
        ) from failed
    assert failed is not None
    raise failed


def _results(client: Client, ranks: dict[int, str], futures: list[Future], timeout: float
             ) -> tuple[list[Any], list[tuple[int, str]], dict[int, str]]:
    """The results of finished tasks; else the ranks whose worker left before its result was
    fetched (the result went with the worker, and Dask would wait for that pinned task to run
    there again, for ever: a worker killed just after its rendezvous store had started), or the
    rank whose result did not come within ``timeout``."""
    deadline = time.monotonic() + timeout
    results: list[Any] = []
    for rank, fut in enumerate(futures):
        while True:
            try:
                results.append(fut.result(timeout=1.0))
                break
            except (TimeoutError, CancelledError):
                present = set(live_workers(client))
                gone = [(r, a) for r, a in ranks.items() if r < len(futures) and a not in present]
                if gone:
                    return [], gone, {}
                if time.monotonic() > deadline or fut.cancelled():
                    return [], [], {rank: ranks[rank]}
    return results, [], {}


def _wait_ranks(client: Client, ranks: dict[int, str], futures: list[Future], timeout: float
                ) -> tuple[BaseException | None, list[tuple[int, str]]]:
    """Wait for the ranks' tasks: (the first failure, the ranks whose worker left).

    Looks at the cluster every second: a task pinned to a worker that died waits for it
    forever, and its peers in the rendezvous until the timeout; a lost worker ends the wait now.
    """
    deadline = time.monotonic() + timeout
    while True:
        waiting = [f for f in futures if not f.done()]
        left = deadline - time.monotonic()
        if not waiting or left <= 0:
            return None, []
        try:
            # loop=: this client's loop, not the default client's (see TorchGroup.gather).
            for fut in as_completed(waiting, loop=client.loop, timeout=min(1.0, left)):
                if fut.status != "finished":
                    return _outcome(fut), []
        except TimeoutError:
            pass
        present = set(live_workers(client))
        lost = [(r, a) for r, a in ranks.items() if r < len(futures) and a not in present]
        if lost:
            return None, lost


def _check_args(*, workers: object, backend: object, timeout: object) -> list[str]:
    problems = []
    if isinstance(workers, bool) or not isinstance(workers, (int, list, tuple)):
        problems.append(f"workers={workers!r} is invalid: use a number of ranks or a list of addresses.")
    elif isinstance(workers, int) and workers < 1:
        problems.append(f"workers={workers!r} is invalid: use an integer >= 1.")
    elif isinstance(workers, (list, tuple)) and not (workers and all(isinstance(w, str) for w in workers)):
        problems.append(f"workers={workers!r} is invalid: list at least one worker address (str).")
    if backend not in BACKENDS:
        problems.append(f"backend={backend!r} is invalid: use one of {', '.join(map(repr, BACKENDS))}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        problems.append(f"timeout={timeout!r} is invalid: use a number of seconds > 0.")
    return problems


def _place_when_free(*, client: Client, workers: int | Sequence[str], nccl: bool, timeout: float
                     ) -> tuple[list[str], list[str]]:
    """:func:`_place`, again while a worker it needs is still leaving a closed group, up to
    ``timeout``.

    A rank's join blocked in torch's rendezvous (connecting to a store whose worker was lost)
    cannot be interrupted and ends within its group's timeout: a job's next generation, started
    at once on the same workers, found them "still leaving" and failed with InvalidInput
    (tests/chaos/test_moments.py, once in a sequential run of the suite).
    """
    deadline = time.monotonic() + timeout
    while True:
        addrs, problems, waits = _place(client=client, workers=workers, nccl=nccl)
        if not waits or time.monotonic() > deadline:
            return addrs, problems
        time.sleep(0.1)


def _place(*, client: Client, workers: int | Sequence[str], nccl: bool
           ) -> tuple[list[str], list[str], bool]:
    """Chosen worker addresses in rank order, every problem with them, and whether they would
    all be solved by workers leaving the closed groups they are still leaving."""
    known = sorted(live_workers(client))
    wanted = known if isinstance(workers, int) else list(workers)
    problems = [f"workers lists {a!r} {wanted.count(a)} times: one rank per worker process."
                for a in dict.fromkeys(wanted) if wanted.count(a) > 1]
    problems += [f"workers: {a!r} is not a worker of this cluster (its workers: {known})."
                 for a in dict.fromkeys(wanted) if a not in known]
    candidates = [a for a in dict.fromkeys(wanted) if a in known]
    answers = client.run(probe, nccl, workers=candidates, on_error="return") if candidates else {}
    for a, p in answers.items():
        if isinstance(p, OSError):  # its connection closed: the worker died as it was asked
            rank = wanted.index(a) if not isinstance(workers, int) else None
            raise WorkerLost(f"worker {a} was lost while the ranks were placed: {p!r}",
                             worker=a, role="trainer" if rank is None else f"trainer-{rank}")
    info = {a: p if isinstance(p, dict) else {"problem": f"worker {a} did not answer: {p!r}."}
            for a, p in answers.items()}
    if isinstance(workers, int):
        # Least loaded first (tasks queued or running there), then address order; one per process.
        load = client.processing(workers=candidates)
        order = sorted(candidates, key=lambda a: (len(load.get(a, ())), a))
        processes: dict[str, str] = {}
        for a in order:
            if not info[a]["problem"] and len(processes) < workers:
                processes.setdefault(info[a]["process"], a)
        chosen = list(processes.values())
        soon = {info[a]["process"] for a in candidates
                if not info[a]["problem"] or info[a].get("leaving")}
        waits = len(chosen) < workers <= len(soon)
        if len(chosen) < workers:
            taken = [info[a]["problem"] for a in candidates if info[a]["problem"]]
            problems.append(
                f"workers={workers} asks for {workers} ranks but the cluster has {len(known)} worker "
                "processes, and torch's default process group is per process, so each rank needs its "
                "own: start more workers or ask for fewer ranks."
                + "".join(f" ({len(taken)} unavailable: {' '.join(taken)})" for _ in taken[:1])
            )
    else:
        chosen = candidates
        # Only the chosen workers' leaving stands in the way: no other problem, now or after.
        waits = not problems and any(info[a].get("leaving") for a in chosen) and all(
            info[a].get("leaving") or not info[a]["problem"] for a in chosen)
        problems += [info[a]["problem"] for a in chosen if info[a]["problem"]]
        seen: dict[str, str] = {}
        for a in chosen:
            if (first := seen.setdefault(info[a].get("process", a), a)) != a:
                waits = False
                problems.append(
                    f"workers {first!r} and {a!r} run in one process, and torch's default process "
                    "group is per process: use worker processes (LocalCluster(processes=True))."
                )
    if nccl:
        no_cuda = [a for a in chosen if not info[a].get("cuda")]
        problems += [f"backend='nccl' needs CUDA, but torch.cuda.is_available() is False on {a}: "
                     "use backend='gloo' for CPU workers." for a in no_cuda]
        waits = waits and not no_cuda
    return chosen, problems, waits
