"""Processes of this machine, by pid: whether one still runs (a shared-memory segment's owner,
a host sum's peer, the process that made a network namespace)."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (one of another user counts as alive).

    Signal 0 checks without sending anything: the kernel answers whether the pid exists and
    whether we may signal it; a pid we may not signal (``PermissionError``) is a live process.

    Examples
    --------
    >>> pid_alive(os.getpid())
    True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
