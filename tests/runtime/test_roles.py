"""Role placement, the plugin on real workers, and connecting."""

from __future__ import annotations

import socket

import pytest
from distributed import Client

import dask_train as dt
from dask_train.data._cluster import live_workers
from dask_train.policy import plan_roles


def test_plan_spreads_trainers_first() -> None:
    plan = plan_roles({"a": 1, "b": 1}, ps=1, worker=2, scorer=1)
    assert plan == {"trainer": ["a", "b"], "ps": ["a"], "scorer": ["b"]}


def test_plan_shares_processes_when_roles_outnumber_workers() -> None:
    plan = plan_roles({"a": 1}, ps=2, worker=3, scorer=1)
    assert plan["trainer"] == ["a", "a", "a"] and plan["ps"] == ["a", "a"]


def test_plan_uses_every_worker_before_sharing() -> None:
    workers = {f"w{i}": 1 for i in range(6)}
    plan = plan_roles(workers, ps=2, worker=3, scorer=1)
    placed = plan["trainer"] + plan["ps"] + plan["scorer"]
    assert sorted(placed) == sorted(workers)


def test_plan_without_workers_is_an_error() -> None:
    with pytest.raises(dt.InvalidInput, match="no workers"):
        plan_roles({}, ps=1, worker=1, scorer=0)


def test_start_roles_on_the_cluster(client: Client) -> None:
    roles = dt.start_roles(client, ps=2, worker=2, scorer=1)
    workers = set(live_workers(client))
    assert len(roles["ps"]) == 2 and len(roles["trainer"]) == 2 and len(roles["scorer"]) == 1
    assert set(roles.addresses) <= workers
    assert set(roles["trainer"]) == workers  # two trainers on two workers: one each
    have = client.run(lambda dask_worker: "dask-train" in dask_worker.plugins)
    assert all(have.values())


def test_start_roles_rejects_bad_counts(client: Client) -> None:
    with pytest.raises(dt.InvalidInput) as info:
        dt.start_roles(client, ps=-1, worker=0, scorer=2)
    assert len(info.value.problems) == 3
    assert "workers=0 is invalid" in str(info.value)


def test_connect_to_an_unreachable_scheduler_names_the_address() -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    with pytest.raises(dt.ClusterUnreachable) as info:
        dt.connect(address, timeout=2)
    assert address in str(info.value)
    assert isinstance(info.value, TimeoutError)


def test_connect_rejects_bad_arguments() -> None:
    with pytest.raises(dt.InvalidInput) as info:
        dt.connect(n_workers=0, threads_per_worker=0, timeout=0)
    assert len(info.value.problems) == 3


def test_connect_by_address_installs_the_plugin(client: Client) -> None:
    other = dt.connect(client.scheduler.address, quiet=True)
    try:
        threads = other.run(lambda: __import__("torch").get_num_threads())
        assert set(threads.values()) == {1}
    finally:
        other.close()


def test_connect_reads_the_scheduler_address_from_the_environment(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", client.scheduler.address)
    other = dt.connect(quiet=True)
    try:
        assert other.scheduler.address == client.scheduler.address
        assert set(live_workers(other)) == set(live_workers(client))
    finally:
        other.close()
