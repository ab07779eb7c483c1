"""dt.connect refuses a cluster whose processes run other software than the client."""

from __future__ import annotations

import pytest
from distributed import LocalCluster

import dask_train as dt
from dask_train.runtime._versions import version_problems

SAME = {"python": "3.11.7.final.0", "dask": "2026.8.0", "distributed": "2026.8.0",
        "dask_train": "0.1.0", "torch": "2.13.0+cpu", "cloudpickle": "3.1.3"}


def _versions(scheduler: dict | None = None, **workers: dict) -> dict:
    return {"client": {"packages": SAME}, "scheduler": {"packages": {**SAME, **(scheduler or {})}},
            "workers": {f"tcp://10.0.0.{i}:1": {"packages": {**SAME, **w}}
                        for i, w in enumerate(workers.values())}}


def test_the_same_software_everywhere_passes() -> None:
    assert version_problems(_versions(a={}, b={})) == []


def test_every_difference_is_named_with_the_process_the_package_and_the_fix() -> None:
    problems = version_problems(_versions({"distributed": "2025.1.0", "torch": None},
                                          a={"dask_train": None}, b={"torch": "2.4.0"},
                                          c={"python": "3.12.3.final.0"}))
    assert problems[0].startswith("scheduler runs distributed 2025.1.0, the client 2026.8.0")
    # The scheduler needs no torch: its missing torch is no problem.
    assert problems[1].startswith("worker tcp://10.0.0.0:1 cannot import dask_train (the client "
                                  "has 0.1.0): pip install dask-train==0.1.0 there")
    assert problems[2].startswith("worker tcp://10.0.0.1:1 runs torch 2.4.0, the client 2.13.0+cpu")
    assert problems[3].startswith("worker tcp://10.0.0.2:1 runs Python 3.12, the client 3.11")
    assert len(problems) == 4 and all("docs/deploy.md" in p for p in problems)


def test_connect_checks_a_remote_cluster() -> None:
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster:
        client = dt.connect(cluster.scheduler_address, quiet=True)
        try:
            assert client.status == "running"
        finally:
            client.close()


def test_a_mismatch_is_an_invalid_input() -> None:
    with pytest.raises(dt.InvalidInput):
        raise dt.ClusterMismatch(version_problems(_versions(a={"torch": None})))
