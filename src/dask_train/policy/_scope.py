"""Which Dask workers the current job may use: every live worker, or a reserved group.

A hyper-parameter search runs several jobs at once on one cluster, each on its own workers (a
"gang" reserved all at once, so two jobs never wait on each other for half of what they need).
A job learns its workers from this scope, not from an argument threaded through every layer: the
places that ask the cluster which workers exist (role placement, the liveness check, where blocks
are spread, where a lost role is replaced) filter the answer with :func:`in_scope`.

The scope is a :class:`contextvars.ContextVar`, so it follows the job into the client's event loop:
``Client.sync`` schedules its coroutine from the calling thread, and asyncio copies that thread's
context into the callback and every task created from it. Two jobs started from two threads each
see their own scope.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dask_train.errors import InvalidInput

V = TypeVar("V")


@dataclass(frozen=True)
class WorkerScope:
    """The workers a job may use, and an optional cache shared by the jobs of one search.

    Attributes
    ----------
    workers : frozenset of str
        Dask worker addresses.
    cache : dict or None
        Persisted data by key (see :func:`dask_train.data.persist_blocks`): a search persists its
        data on a group of workers once and every trial on that group reuses it. None: no cache.
    """

    workers: frozenset[str]
    cache: dict[Any, Any] | None = field(default=None, compare=False, repr=False)


_SCOPE: ContextVar[WorkerScope | None] = ContextVar("dask_train_worker_scope", default=None)


@contextmanager
def use_workers(workers: Iterable[str], *, cache: dict[Any, Any] | None = None
                ) -> Iterator[WorkerScope]:
    """Run the enclosed jobs on ``workers`` only.

    Parameters
    ----------
    workers : iterable of str
        Dask worker addresses, at least one.
    cache : dict, optional
        Shared between scopes (a search's trials) to persist the same data once per group.

    Examples
    --------
    >>> with use_workers(["tcp://a:1"]) as scope:
    ...     in_scope({"tcp://a:1": 1, "tcp://b:2": 1})
    {'tcp://a:1': 1}
    >>> in_scope({"tcp://a:1": 1, "tcp://b:2": 1})
    {'tcp://a:1': 1, 'tcp://b:2': 1}
    """
    chosen = frozenset(workers)
    if not chosen or not all(isinstance(w, str) for w in chosen):
        raise InvalidInput([f"workers={sorted(chosen)!r} is invalid: list at least one worker "
                            "address (str)."])
    scope = WorkerScope(chosen, cache)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def current_scope() -> WorkerScope | None:
    """The scope of the job running in this context, or None (every worker)."""
    return _SCOPE.get()


def in_scope(workers: Mapping[str, V]) -> dict[str, V]:
    """``workers`` (address -> anything) restricted to the current scope's workers."""
    scope = _SCOPE.get()
    if scope is None:
        return dict(workers)
    return {address: value for address, value in workers.items() if address in scope.workers}
