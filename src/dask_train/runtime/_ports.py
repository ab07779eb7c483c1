"""A free TCP port on this machine, for a rendezvous that a program started later binds."""

from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A port the OS reports free on ``host``'s interface now.

    Released at once, as torchrun's ``get_free_port`` does: the program that binds it (rank 0's
    ``init_process_group`` under ``env://``) runs in another process. Port 0 asked of the OS
    never collides with a port in use, as a fixed one (dask-pytorch-ddp's 23456) does; another
    program could still take it in the moment between, which the rank then reports.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, 0))
        except OSError:  # a name or address this machine does not hold: any interface
            sock.bind(("", 0))
        return int(sock.getsockname()[1])
