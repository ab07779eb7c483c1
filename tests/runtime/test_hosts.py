"""runtime._hosts: the one parser of a Dask worker address's host, and of ``host:port``."""

from __future__ import annotations

import pytest
from distributed.comm import get_address_host
from distributed.comm.inproc import global_manager

from dask_train.errors import InvalidInput
from dask_train.runtime._hosts import (
    address_scheme,
    local_ranks,
    split_endpoint,
    worker_host,
    worker_hosts,
)


@pytest.mark.parametrize(("address", "host"), [
    ("tcp://10.0.0.2:4000", "10.0.0.2"),
    ("tls://10.0.0.2:4000", "10.0.0.2"),
    ("ucx://10.0.0.2:4000", "10.0.0.2"),
    ("tcp://[::1]:4000", "::1"),
    ("tls://[fe80::1%eth0]:4000", "fe80::1%eth0"),
    ("tcp://[::1]", "::1"),
    ("tcp://Node-7.Example.org:4000", "Node-7.Example.org"),
    ("tcp://localhost:4000", "localhost"),
    ("tcp://10.0.0.2", "10.0.0.2"),
    ("inproc://10.0.0.2/1234/5", "10.0.0.2"),
    ("10.0.0.2:4000", "10.0.0.2"),
    ("node-7:4000", "node-7"),
    ("node-7", "node-7"),
    ("::1", "::1"),
])
def test_worker_host(address: str, host: str) -> None:
    assert worker_host(address) == host


@pytest.mark.parametrize("address", [
    "tcp://10.0.0.2:4000", "tls://10.0.0.2:4000", "ws://10.0.0.2:4000", "tcp://[::1]:4000",
    "tls://[fe80::1%eth0]:4000", "tcp://node-7.example.org:4000", "10.0.0.2:4000",
])
def test_worker_host_answers_as_distributed_does(address: str) -> None:
    # What the modules that now call worker_host got from get_address_host before.
    assert worker_host(address) == get_address_host(address)


def test_worker_host_of_an_inproc_worker_is_this_process_host_as_distributed_says() -> None:
    address = f"inproc://{global_manager.new_address()}"
    assert worker_host(address) == get_address_host(address) == global_manager.ip


@pytest.mark.parametrize("address", [
    "", "tcp://", "tcp://:4000", "tcp://[::1", "tcp://[::1]x", "tcp://host:port", "inproc://",
])
def test_worker_host_names_what_it_cannot_parse(address: str) -> None:
    with pytest.raises(InvalidInput, match="cannot tell the host") as info:
        worker_host(address)
    assert repr(address) in str(info.value)


def test_worker_host_refuses_a_non_string() -> None:
    with pytest.raises(InvalidInput, match="not a Dask worker address"):
        worker_host(4000)  # type: ignore[arg-type]


@pytest.mark.parametrize(("address", "endpoint"), [
    ("10.0.0.2:4000", ("10.0.0.2", 4000)),
    ("node-7:4000", ("node-7", 4000)),
    ("tcp://10.0.0.2:4000", ("10.0.0.2", 4000)),
    ("tls://10.0.0.2:4000", ("10.0.0.2", 4000)),
    ("tcp://[::1]:4000", ("::1", 4000)),
    ("[fe80::1%eth0]:4000", ("fe80::1%eth0", 4000)),
    # f"{host}:{port}" of an IPv6 host, as a rendezvous store or a push server writes it.
    ("::1:4000", ("::1", 4000)),
    ("fe80::1:0", ("fe80::1", 0)),
])
def test_split_endpoint(address: str, endpoint: tuple[str, int]) -> None:
    assert split_endpoint(address) == endpoint


@pytest.mark.parametrize("address", [
    "", "10.0.0.2", "10.0.0.2:", ":4000", "tcp://10.0.0.2", "tcp://[::1]", "[::1]x4000",
    "[::1:4000", "host:port", "host:-1", "inproc://10.0.0.2/1234/5",
])
def test_split_endpoint_names_what_has_no_port(address: str) -> None:
    with pytest.raises(InvalidInput, match="not a host:port endpoint") as info:
        split_endpoint(address)
    assert repr(address) in str(info.value)


def test_split_endpoint_refuses_a_non_string() -> None:
    with pytest.raises(InvalidInput, match="not a Dask worker address"):
        split_endpoint(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("address", "scheme"), [
    ("tcp://10.0.0.2:4000", "tcp"), ("tls://[::1]:4000", "tls"),
    ("inproc://10.0.0.2/1234/5", "inproc"), ("10.0.0.2:4000", ""), ("node-7", ""),
])
def test_address_scheme(address: str, scheme: str) -> None:
    assert address_scheme(address) == scheme


def test_worker_hosts_leave_out_the_workers_of_this_process() -> None:
    addresses = ["tcp://10.0.0.5:1", "inproc://10.0.0.5/1234/1", "tls://[::1]:2"]
    assert worker_hosts(addresses) == ["10.0.0.5", "::1"]


def test_local_ranks_count_ranks_per_host_for_the_gpu_choice() -> None:
    addresses = ["tcp://10.0.0.5:1", "tcp://10.0.0.6:2", "tcp://10.0.0.5:3", "tcp://[::1]:4",
                 "tcp://10.0.0.5:5", "tcp://[::1]:6"]
    assert local_ranks(addresses) == [0, 0, 1, 0, 2, 1]
