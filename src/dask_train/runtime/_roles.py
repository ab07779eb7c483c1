"""Placing a job's roles on a live cluster: the plan (pure, in ``policy``) plus the worker plugin."""

from __future__ import annotations

from distributed import Client

from dask_train.errors import InvalidInput
from dask_train.policy._placement import Roles, check_role_counts, plan_roles
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
