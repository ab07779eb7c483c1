"""The host of a Dask worker address: one parser for every module that groups or compares
workers by host (devices per host, shared memory, push sockets, torch's rendezvous and ranks per
host, the launcher, the TensorFlow chief, the namespace harness), and of the ``host:port``
endpoints dask-train hands out (a rendezvous store, a push server).

For every address a Dask worker has, :func:`worker_host` answers what distributed's
``get_address_host`` does (tcp, tls, ws: the host, IPv6 brackets stripped; inproc: the host the
address names, which is the process's own). It also reads what that one refuses (an address with
no port; an inproc address of another process) without connecting anywhere or reading config.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dask_train.errors import InvalidInput

__all__ = ["address_scheme", "local_ranks", "split_endpoint", "worker_host", "worker_hosts"]


def address_scheme(address: str) -> str:
    """The scheme of a Dask address (``"tcp"``, ``"tls"``, ``"inproc"``, ...), ``""`` for a
    bare ``host:port``.

    Examples
    --------
    >>> address_scheme("tls://10.0.0.2:4000")
    'tls'
    >>> address_scheme("10.0.0.2:4000")
    ''
    """
    return _parts(address)[0]


def worker_host(address: str) -> str:
    """The host part of a Dask address, without scheme, port or IPv6 brackets.

    Parameters
    ----------
    address : str
        ``scheme://host:port`` (tcp, tls, ucx, ...), ``inproc://host/pid/n``, or a bare
        ``host:port`` or ``host``.

    Returns
    -------
    str
        The host as written in the address (not resolved, case kept).

    Raises
    ------
    InvalidInput
        For an address with no host in it, naming the value.

    Examples
    --------
    >>> worker_host("tcp://10.0.0.2:4000")
    '10.0.0.2'
    >>> worker_host("tcp://[::1]:4000")
    '::1'
    >>> worker_host("inproc://10.0.0.2/1234/5")
    '10.0.0.2'
    """
    scheme, rest = _parts(address)
    if scheme == "inproc":
        # Dask's in-process addresses are host/pid/counter: no port, the host before the slash.
        host = rest.split("/", 1)[0]
    elif rest.startswith("["):
        # IPv6 is bracketed so that its colons are not taken for the port's.
        host, bracket, tail = rest[1:].partition("]")
        if not bracket or (tail and not (tail.startswith(":") and tail[1:].isdigit())):
            host = ""
    elif rest.count(":") > 1:
        # An unbracketed IPv6 literal: the port cannot be told apart, so nothing is stripped.
        host = rest
    else:
        host, colon, port = rest.partition(":")
        if colon and not port.isdigit():
            host = ""
    if not host:
        raise InvalidInput([f"cannot tell the host of the Dask address {address!r}"])
    return host


def split_endpoint(address: str) -> tuple[str, int]:
    """The host and port of ``host:port``, with or without a scheme (``tcp://host:port``).

    An IPv6 host may be bracketed (``[::1]:4000``, as Dask writes it) or not (``::1:4000``, as
    ``f"{host}:{port}"`` writes it from :func:`worker_host`'s answer): the port is after the
    last colon.

    Raises
    ------
    InvalidInput
        For an address without a host or a numeric port, naming the value.

    Examples
    --------
    >>> split_endpoint("10.0.0.2:4000")
    ('10.0.0.2', 4000)
    >>> split_endpoint("tcp://[::1]:4000")
    ('::1', 4000)
    >>> split_endpoint("::1:4000")
    ('::1', 4000)
    """
    scheme, rest = _parts(address)
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        port = tail[1:] if bracket and tail.startswith(":") else ""
    else:
        host, _, port = rest.rpartition(":")
    if scheme == "inproc" or not host or not port.isdigit():
        raise InvalidInput([f"{address!r} is not a host:port endpoint"])
    return host, int(port)


def worker_hosts(addresses: Iterable[str]) -> list[str]:
    """The hosts of worker addresses (:func:`worker_host`), those of workers in this process
    (``inproc://``) left out: what tells whether workers share a machine with this one."""
    return [worker_host(a) for a in addresses if address_scheme(a) != "inproc"]


def local_ranks(addresses: Sequence[str]) -> list[int]:
    """Each rank's index among the ranks on the same host, in rank order (torchrun's
    ``LOCAL_RANK``; with nccl it picks the rank's GPU).

    Examples
    --------
    >>> local_ranks(["tcp://10.0.0.5:1", "tcp://10.0.0.6:2", "tcp://10.0.0.5:3"])
    [0, 0, 1]
    """
    seen: dict[str, int] = {}
    out = []
    for address in addresses:
        host = worker_host(address)
        out.append(seen.get(host, 0))
        seen[host] = out[-1] + 1
    return out


def _parts(address: str) -> tuple[str, str]:
    """``(scheme, the rest)`` of a Dask address; the scheme is ``""`` without one."""
    if not isinstance(address, str):
        raise InvalidInput([f"{address!r} is not a Dask worker address (a string)"])
    scheme, sep, rest = address.partition("://")
    return (scheme, rest) if sep else ("", address)
