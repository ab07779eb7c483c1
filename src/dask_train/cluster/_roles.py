"""Role placement: which Dask worker runs each parameter server, trainer and scorer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from distributed import Client

from dask_train.cluster._plugin import PLUGIN_NAME, DaskTrainPlugin
from dask_train.errors import InvalidInput

# Relative load of a role on its process, used to spread roles when they must share workers:
# a trainer computes all the time, a server applies updates, a scorer wakes once a second.
_WEIGHT = {"worker": 1.0, "ps": 0.5, "scorer": 0.25}


@dataclass(frozen=True)
class Roles:
    """Placement of a job's roles: role kind -> list of Dask worker addresses (one per instance).

    Examples
    --------
    >>> roles = Roles({"ps": ["tcp://a:1"], "worker": ["tcp://a:1", "tcp://b:2"], "scorer": []})
    >>> roles["worker"][1], roles.addresses
    ('tcp://b:2', ['tcp://a:1', 'tcp://b:2'])
    """

    placement: Mapping[str, Sequence[str]] = field(default_factory=dict)

    def __getitem__(self, kind: str) -> list[str]:
        return list(self.placement.get(kind, []))

    def keys(self) -> list[str]:
        """Role kinds."""
        return list(self.placement)

    @property
    def addresses(self) -> list[str]:
        """Every worker address that holds at least one role, sorted."""
        return sorted({a for addrs in self.placement.values() for a in addrs})

    def names_on(self, address: str) -> list[str]:
        """Role names (``"ps-0"``, ``"worker-1"``) placed on ``address``."""
        return [
            f"{kind}-{i}"
            for kind, addrs in self.placement.items()
            for i, a in enumerate(addrs)
            if a == address
        ]

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={list(v)}" for k, v in self.placement.items())
        return f"Roles({body})"


def plan_roles(
    workers: Mapping[str, int], *, ps: int, worker: int, scorer: int
) -> dict[str, list[str]]:
    """Place roles on workers, spreading load; pure and deterministic.

    Trainers are placed first, one per worker while there are free workers, so compute never
    shares a process when it need not; then servers and the scorer go to the least-loaded workers.
    With fewer workers than roles, roles share processes (the seed's "same host, other port").

    Parameters
    ----------
    workers : mapping of str to int
        Worker address -> number of Dask threads.
    ps, worker, scorer : int
        Number of parameter servers, trainers and scorers.

    Examples
    --------
    >>> plan_roles({"a": 1, "b": 1}, ps=1, worker=2, scorer=1)
    {'worker': ['a', 'b'], 'ps': ['a'], 'scorer': ['b']}
    """
    if not workers:
        raise InvalidInput(["the cluster has no workers: start at least one Dask worker."])
    load = {addr: 0.0 for addr in sorted(workers)}
    placement: dict[str, list[str]] = {}
    for kind, count in (("worker", worker), ("ps", ps), ("scorer", scorer)):
        placement[kind] = []
        for _ in range(count):
            # Least loaded first; ties go to the worker with more threads, then to address order.
            addr = min(load, key=lambda a: (load[a] / max(workers[a], 1), -workers[a], a))
            placement[kind].append(addr)
            load[addr] += _WEIGHT[kind]
    return placement


def start_roles(client: Client, *, ps: int = 1, worker: int = 1, scorer: int = 1) -> Roles:
    """Place a job's roles on the cluster's workers and install dask-train's plugin there.

    Parameters
    ----------
    client : distributed.Client
    ps : int
        Parameter servers (async-ps), >= 0.
    worker : int
        Trainers, >= 1.
    scorer : int
        Scorers, 0 or 1.

    Returns
    -------
    Roles

    Examples
    --------
    >>> roles = start_roles(client, ps=2, worker=2, scorer=1)   # doctest: +SKIP
    >>> roles["ps"]                                              # doctest: +SKIP
    ['tcp://127.0.0.1:40233', 'tcp://127.0.0.1:41877']
    """
    problems = check_role_counts(ps=ps, worker=worker, scorer=scorer, min_ps=0)
    if problems:
        raise InvalidInput(problems)
    info = client.scheduler_info(n_workers=-1)["workers"]
    threads = {addr: int(w.get("nthreads", 1)) for addr, w in info.items()}
    ensure_plugin(client)
    return Roles(plan_roles(threads, ps=ps, worker=worker, scorer=scorer))


def ensure_plugin(client: Client) -> None:
    """Register the dask-train worker plugin unless every worker already has it."""
    have = client.run(_has_plugin)
    if not have or not all(have.values()):
        client.register_plugin(DaskTrainPlugin(), name=PLUGIN_NAME)


def _has_plugin(dask_worker: object) -> bool:
    return PLUGIN_NAME in getattr(dask_worker, "plugins", {})


def check_role_counts(*, ps: object, worker: object, scorer: object, min_ps: int = 1) -> list[str]:
    """Problems with role counts, one message each (empty when all are valid)."""
    problems = []
    for name, value, low in (("ps", ps, min_ps), ("workers", worker, 1), ("scorer", scorer, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            problems.append(f"{name}={value!r} is invalid: use an integer >= {low}.")
    if isinstance(scorer, int) and scorer > 1:
        problems.append(f"scorer={scorer!r} is invalid: use 0 (no scoring) or 1.")
    return problems
