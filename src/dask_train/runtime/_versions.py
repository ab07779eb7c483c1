"""The same software everywhere: the client, the scheduler and every worker of a remote cluster.

A worker without dask-train fails its first role with an ``ImportError`` deep in a task; a worker
with another torch or cloudpickle fails to unpickle the model, or trains something else. So
:func:`dask_train.connect` asks every process for its versions once (Dask's ``get_versions``,
one round trip) and refuses a cluster that differs, naming the process, the package, both versions
and the fix.

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

from collections.abc import Mapping
from typing import Any

#: What every worker must run as the client does (the roles unpickle the client's objects).
WORKER_PACKAGES = ("dask_train", "dask", "distributed", "torch", "cloudpickle")
#: What the scheduler must run as the client does.
SCHEDULER_PACKAGES = ("dask", "distributed")

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
            if have is None:
                problems.append(f"{name} cannot import {package} (the client has {want}): "
                                f"pip install {package.replace('_', '-')}=={want} there, or "
                                f"{_FIX}")
            elif have != want:
                problems.append(f"{name} runs {package} {have}, the client {want}: {_FIX}")
    return problems


def check_versions(client: Any) -> None:
    """Raise :class:`~dask_train.errors.ClusterMismatch` when the cluster differs from the client.

    Raises
    ------
    ClusterMismatch
        Listing every process, package and version that differ, with the fix.
    """
    from dask_train.errors import ClusterMismatch

    problems = version_problems(client.get_versions(packages=list(WORKER_PACKAGES)))
    if problems:
        raise ClusterMismatch(problems)
