"""The same software everywhere: the client, the scheduler and every worker of a remote cluster.

A worker without dask-train fails its first role with an ``ImportError`` deep in a task; a worker
with another torch or cloudpickle fails to unpickle the model, or trains something else; a
scheduler without dask-train fails the first fit with "Error during deserialization of the task
graph" (it unpickles the task graphs, which name dask-train's functions). So
:func:`dask_train.connect`, and the first fit on a client made otherwise (:func:`check_once`),
ask every process for its versions once (Dask's ``get_versions``) and the scheduler to import
dask-train (``runtime._scheduler_probe``: package metadata can name a package that does not
import), and refuse a cluster that differs, naming the process, the package, both versions and
the fix.

Examples
--------
>>> same = {"dask": "1", "distributed": "1", "dask_train": "0.1", "torch": "2", "cloudpickle": "3",
...         "python": "3.11.7.final.0"}
>>> versions = {"client": {"packages": same}, "scheduler": {"packages": same},
...             "workers": {"tcp://w:1": {"packages": {**same, "dask_train": None}}}}
>>> version_problems(versions)[0].split(" (")[0]
'worker tcp://w:1 cannot import dask_train'
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

#: What every worker must run as the client does (the roles unpickle the client's objects).
WORKER_PACKAGES = ("dask_train", "dask", "distributed", "torch", "cloudpickle")
#: What the scheduler must run as the client does (it unpickles task graphs naming dask-train).
SCHEDULER_PACKAGES = ("dask_train", "dask", "distributed")

_FIX = ("install the client's versions in the cluster's environment (the same container image "
        "for the client, scheduler and workers: docs/deploy.md)")


def _python(version: Any) -> str:
    """Python's major.minor from Dask's ``"3.11.7.final.0"``."""
    return ".".join(str(version).split(".")[:2]) if version else "?"


def version_problems(versions: Mapping[str, Any]) -> list[str]:
    """Every difference between the client and the cluster's processes, one sentence each.

    ``versions`` is what ``Client.get_versions(packages=WORKER_PACKAGES)`` returns.
    """
    client = versions["client"]["packages"]
    problems: list[str] = []
    processes: list[tuple[str, Any, tuple[str, ...]]] = [
        ("scheduler", versions.get("scheduler") or {}, SCHEDULER_PACKAGES)]
    processes += [(f"worker {address}", info, WORKER_PACKAGES)
                  for address, info in sorted((versions.get("workers") or {}).items())]
    for name, info, packages in processes:
        theirs = info.get("packages") or {}
        if _python(theirs.get("python")) != _python(client.get("python")):
            problems.append(f"{name} runs Python {_python(theirs.get('python'))}, the client "
                            f"{_python(client.get('python'))}: pickled objects may not load; "
                            f"{_FIX}")
        for package in packages:
            want, have = client.get(package), theirs.get(package)
            if want is None:
                continue  # the client itself lacks it: nothing to compare with
            if name == "scheduler" and package == "dask_train" and have != want:
                problems.append(_scheduler_problem(want, have, info.get("dask_train_error")))
            elif have is None:
                problems.append(f"{name} cannot import {package} (the client has {want}): "
                                f"pip install {package.replace('_', '-')}=={want} there, or "
                                f"{_FIX}")
            elif have != want:
                problems.append(f"{name} runs {package} {have}, the client {want}: {_FIX}")
    return problems


def _scheduler_problem(want: str, have: str | None, error: str | None) -> str:
    """The scheduler's dask-train differs from the client's: why that matters, and the fix."""
    found = (f"cannot import dask_train ({error or 'not installed'}; the client has {want})"
             if have is None else f"runs dask_train {have}, the client {want}")
    return (f"scheduler {found}: the scheduler unpickles every task graph, and a fit's graphs "
            "name dask-train's functions, so the first fit would fail with \"Error during "
            f"deserialization of the task graph\"; install dask-train {want} in the scheduler's "
            f"environment (pip install dask-train=={want} where `dask scheduler` runs) and "
            f"restart it, or {_FIX}")


def check_versions(client: Any) -> None:
    """Raise :class:`~dask_train.errors.ClusterMismatch` when the cluster differs from the client;
    a scheduler that passes gets dask-train's log filters (it can import dask-train now).

    Raises
    ------
    ClusterMismatch
        Listing every process, package and version that differ, with the fix.
    """
    from dask_train.errors import ClusterMismatch
    from dask_train.runtime._scheduler_probe import dask_train_here, scheduler_dask_train

    versions = client.get_versions(packages=list(WORKER_PACKAGES))
    # dask-train as each side imports it, not as package metadata says (see the probe).
    versions["client"]["packages"]["dask_train"] = dask_train_here()["version"]
    scheduler = versions.setdefault("scheduler", {})
    scheduler.setdefault("packages", {})
    try:
        found = scheduler_dask_train(client)
    except Exception:  # a scheduler refusing to run functions: its package metadata must do
        logger.debug("the scheduler did not run the dask-train import probe", exc_info=True)
    else:
        scheduler["packages"]["dask_train"] = found["version"]
        scheduler["dask_train_error"] = found["error"]
    problems = version_problems(versions)
    if problems:
        raise ClusterMismatch(problems)
    _quiet_scheduler(client)


def _quiet_scheduler(client: Any) -> None:
    """Filter a remote scheduler's log as the embedded cluster's (``_quiet_logs.quiet_scheduler``):
    no "Batched Comm Closed" traceback (a script that ends while the scheduler still sends to
    its client, after a lost worker, say, printed one there), and no ERROR for lost blocks that
    dask-train sends again."""
    from dask_train.runtime._quiet_logs import quiet_scheduler

    try:
        client.run_on_scheduler(quiet_scheduler)
    except Exception:  # a scheduler refusing to run functions keeps Dask's own logging
        logger.debug("the scheduler did not install the quiet close", exc_info=True)


#: Attribute of a client: its cluster has passed :func:`check_versions`.
_CHECKED = "_dask_train_checked"


def mark_checked(client: Any) -> None:
    """Note that ``client``'s cluster needs no check (checked, or started here by dask-train),
    and filter this process's log of what dask-train's jobs handle (``quiet_client``)."""
    from dask_train.runtime._quiet_logs import quiet_client

    quiet_client()
    setattr(client, _CHECKED, True)


def check_once(client: Any) -> Any:
    """:func:`check_versions` the first time dask-train uses ``client``; returns ``client``.

    For a client the user made (``Client(address)``, a dask-jobqueue cluster's): ``dt.connect``
    checks its own. Skipped for a LocalCluster of this process (its scheduler runs here, its
    workers from this Python) and for an asynchronous client (the check blocks); a client that
    passed is not checked again.
    """
    from distributed import LocalCluster

    if getattr(client, _CHECKED, False) or getattr(client, "asynchronous", False):
        return client
    if not isinstance(getattr(client, "cluster", None), LocalCluster):
        check_versions(client)
    elif getattr(client.cluster, "scheduler", None) is not None:
        from dask_train.runtime._quiet_logs import quiet_scheduler

        quiet_scheduler()  # a LocalCluster of this process: its scheduler logs here
    mark_checked(client)
    return client
