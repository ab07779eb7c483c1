"""Placing a job's roles on a live cluster: the plan (pure, in ``policy``) plus the worker plugin."""

from __future__ import annotations

from typing import Any

from distributed import Client

from dask_train.data._cluster import declared_resources
from dask_train.errors import InvalidInput
from dask_train.policy._placement import Placement, Roles, check_role_counts, plan_roles
from dask_train.policy._scope import in_scope
from dask_train.runtime._calls import live_workers
from dask_train.runtime._plugin import PLUGIN_NAME, DaskTrainPlugin, handler_names
from dask_train.runtime._versions import check_once


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
        A read-only mapping: role kind (``"ps"``, ``"trainer"``, ``"scorer"``) -> Dask worker
        addresses; ``roles["worker"]``, the seed's name, reads the trainers too.

    Examples
    --------
    >>> roles = start_roles(client, ps=2, worker=2, scorer=1)   # doctest: +SKIP
    >>> roles["ps"]                                              # doctest: +SKIP
    ['tcp://127.0.0.1:40233', 'tcp://127.0.0.1:41877']
    """
    problems = check_role_counts(ps=ps, worker=worker, scorer=scorer, min_ps=0)
    if problems:
        raise InvalidInput(problems)
    ensure_plugin(client)
    return Roles(plan_roles(worker_threads(client), ps=ps, worker=worker, scorer=scorer))


def worker_threads(client: Client) -> dict[str, int]:
    """Live worker address -> its number of Dask threads (in the current job's scope)."""
    info = live_workers(client)
    return in_scope({addr: int(w.get("nthreads", 1)) for addr, w in info.items()})


def trainer_workers(client: Client, placement: Placement) -> dict[str, int]:
    """Live workers (in the job's scope) that can hold one of its trainers: address -> threads."""
    return placement.usable(worker_threads(client), declared_resources(client))


def can_hold(client: Client, placement: Placement, address: str) -> bool:
    """Whether the worker at ``address`` declares the resources one of the job's trainers (a
    rank) holds; a worker that joined since the client's last listing is looked up."""
    if not placement:
        return True
    declared = declared_resources(client)
    if address not in declared:
        worker_threads(client)  # lists the workers again, their resources with them
        declared = declared_resources(client)
    return placement.fits(declared.get(address, {})) > 0


def check_room(client: Client, placement: Placement, *, need: int, what: str,
               one_per_worker: bool) -> None:
    """Refuse, before any work, a job whose ``what`` (``"workers=4"``) needs ``need`` trainers
    when the workers with its resources cannot hold them all: too few declare them, or other
    tasks (another job's trainers) hold them now, which the job's trainers would wait for until
    its timeout. A job without resources passes.

    Raises
    ------
    InvalidInput
        Naming the resource, the workers that have it and the fix.
    """
    if not placement:
        return
    threads = worker_threads(client)
    declared = {a: r for a, r in declared_resources(client).items() if a in threads}
    slots = placement.slots(declared)
    if one_per_worker:  # a rank is one process's torch group: one a worker, whatever it has
        slots = {a: 1 for a in slots}
    if sum(slots.values()) < need:
        raise InvalidInput([placement.too_few(need=need, declared=declared, what=what)])
    used: dict[str, dict[str, float]] = client.run_on_scheduler(_used_resources)
    free = {a: min(n, placement.fits({r: declared[a].get(r, 0) - used.get(a, {}).get(r, 0)
                                      for r in placement.resources}))
            for a, n in slots.items()}
    if sum(free.values()) < need:
        busy = sorted(a for a in slots if free[a] < slots[a])
        raise InvalidInput([
            f"resources={placement.shown}: {what} needs {need} trainer(s) on "
            f"workers with {placement.describe()}, and tasks running now hold them on {busy} "
            f"(another job's trainers?): {sum(free.values())} are free. Wait for that job to "
            "end, add workers with the resources, or lower workers=."])


def _used_resources(dask_scheduler: Any = None) -> dict[str, dict[str, float]]:
    """Run on the scheduler: what the tasks processing on each worker hold of its resources
    (the scheduler's listing says what a worker declares, not what is taken)."""
    return {a: dict(ws.used_resources) for a, ws in dask_scheduler.workers.items()
            if ws.used_resources}


def ensure_plugin(client: Client) -> None:
    """Register the dask-train worker plugin unless every worker has it with every handler.

    The engines register their RPC handlers when :mod:`dask_train.engines` is imported (in the
    client), so a plugin installed at ``connect`` may lack them: register again.
    """
    check_once(client)  # a client the user made: its scheduler and workers, before any role
    need = handler_names()
    if set(need) <= getattr(client, _KNOWN, set()):
        return  # this client registered them all (workers that join or restart get them too)
    have = client.run(_installed_handlers, need)
    if not have or not all(have.values()):
        client.register_plugin(DaskTrainPlugin(), name=PLUGIN_NAME)
    remember_handlers(client)


#: Attribute of a client: the handler names it has registered with its plugin.
_KNOWN = "_dask_train_handlers"


def remember_handlers(client: Client) -> None:
    """Remember that ``client``'s workers have every handler registered in this process so far."""
    setattr(client, _KNOWN, set(handler_names()))


def _installed_handlers(names: list[str], dask_worker: object) -> bool:
    plugin = getattr(dask_worker, "plugins", {}).get(PLUGIN_NAME)
    return plugin is not None and set(names) <= set(getattr(plugin, "handlers", {}))
