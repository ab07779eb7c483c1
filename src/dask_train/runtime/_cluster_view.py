"""The cluster as one listing of the scheduler shows it: the one view the controller's pass and
the engines read (its workers, their threads and hosts, those on their way out, those that
joined since an earlier look), instead of each asking the scheduler again.

A liveness pass of the controller asked the scheduler for its workers three times (the roles'
check, the async trainers' adoption, the arrivals' regroup): one :func:`look` now serves them
all. Losses, notice and the workers a job wants are the controller's own records
(:mod:`dask_train.controller.cluster._losses`, ``_departures``, ``_wanted``); what they compare against
is this view.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from distributed import Client

from dask_train.data._cluster import note_resources
from dask_train.policy._scope import in_scope
from dask_train.runtime._hosts import worker_host

__all__ = ["LEAVING_STATES", "ClusterView", "WorkerSeen", "look"]

#: Worker states in which a worker is on its way out: still listed, never given a new role.
LEAVING_STATES = frozenset({"closing", "closing_gracefully", "closed", "failed"})


@dataclass(frozen=True)
class WorkerSeen:
    """One worker as the scheduler listed it.

    Attributes
    ----------
    threads : int
        Its thread count (``nthreads``).
    status : str or None
        Its status as the scheduler has it (``running``, ``closing_gracefully``, ...).
    """

    threads: int
    status: str | None

    @property
    def leaving(self) -> bool:
        """Whether it is on its way out (retiring, closing after a SIGTERM): still listed for a
        moment, never given a new role."""
        return self.status in LEAVING_STATES


@dataclass(frozen=True)
class ClusterView:
    """The workers of one listing (address -> :class:`WorkerSeen`), in the job's scope.

    Examples
    --------
    >>> view = ClusterView.of({"tcp://10.0.0.1:1": {"nthreads": 2, "status": "running"},
    ...                        "tcp://10.0.0.2:1": {"nthreads": 1, "status": "closing"}})
    >>> view.alive()
    {'tcp://10.0.0.1:1': 2, 'tcp://10.0.0.2:1': 1}
    >>> view.placeable()
    {'tcp://10.0.0.1:1': 2}
    >>> sorted(view.joined(since={"tcp://10.0.0.1:1"}))
    ['tcp://10.0.0.2:1']
    """

    workers: Mapping[str, WorkerSeen]

    @classmethod
    def of(cls, listing: Mapping[str, Mapping[str, Any]]) -> ClusterView:
        """The view of a scheduler's listing (address -> its record of the worker)."""
        return cls(MappingProxyType({
            address: WorkerSeen(threads=int(record.get("nthreads", 1)),
                                status=record.get("status"))
            for address, record in listing.items()}))

    def alive(self) -> dict[str, int]:
        """Every listed worker and its thread count, those on their way out too (a role of
        the job may still run there)."""
        return {address: seen.threads for address, seen in self.workers.items()}

    def placeable(self) -> dict[str, int]:
        """The workers that may take a new role, and their thread counts: not those on their
        way out, which the scheduler still lists for a moment."""
        return {address: seen.threads for address, seen in self.workers.items()
                if not seen.leaving}

    def lost(self, addresses: Iterable[str]) -> set[str]:
        """Those of ``addresses`` that this listing no longer has."""
        return set(addresses) - set(self.workers)

    def joined(self, *, since: Collection[str]) -> set[str]:
        """The listed workers that ``since`` (the workers seen before) did not have."""
        return set(self.workers) - set(since)

    def hosts(self) -> dict[str, list[str]]:
        """Host (:func:`~dask_train.runtime._hosts.worker_host`) -> its listed workers, in the
        listing's order."""
        grouped: dict[str, list[str]] = {}
        for address in self.workers:
            grouped.setdefault(worker_host(address), []).append(address)
        return grouped


async def look(client: Client) -> ClusterView:
    """The scheduler's workers now, in the current job's scope
    (:func:`~dask_train.policy._scope.use_workers`), asked once.

    The resources each worker declares are noted on the client as every listing does
    (:func:`~dask_train.data._cluster.note_resources`).
    """
    info = (await client.scheduler.identity()).get("workers", {})
    note_resources(client, info)
    return ClusterView.of(in_scope(dict(info)))
