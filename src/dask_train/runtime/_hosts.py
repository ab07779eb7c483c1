"""The host of a Dask worker address: one parser for every module that groups or compares
workers by host (devices per host, shared memory, push sockets, the TensorFlow chief, the
namespace harness)."""

from __future__ import annotations

from dask_train.errors import InvalidInput

__all__ = ["worker_host"]


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
    if not isinstance(address, str):
        raise InvalidInput([f"{address!r} is not a Dask worker address (a string)"])
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "", address
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
