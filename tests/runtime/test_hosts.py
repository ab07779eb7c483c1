"""worker_host: the one parser of a Dask worker address's host."""

from __future__ import annotations

import pytest

from dask_train.errors import InvalidInput
from dask_train.runtime._hosts import worker_host


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
    "", "tcp://", "tcp://:4000", "tcp://[::1", "tcp://[::1]x", "tcp://host:port", "inproc://",
])
def test_worker_host_names_what_it_cannot_parse(address: str) -> None:
    with pytest.raises(InvalidInput, match="cannot tell the host") as info:
        worker_host(address)
    assert repr(address) in str(info.value)


def test_worker_host_refuses_a_non_string() -> None:
    with pytest.raises(InvalidInput, match="not a Dask worker address"):
        worker_host(4000)  # type: ignore[arg-type]
