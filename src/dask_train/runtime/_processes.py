"""Processes of this machine, by pid: whether one still runs (a shared-memory segment's owner,
a host sum's peer, the process that made a network namespace)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

__all__ = ["pid_alive", "remove_orphans"]


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


def remove_orphans(where: str, prefix: str | tuple[str, ...], *,
                   owner: Callable[[str], int | None], remove: Callable[[str], None]) -> int:
    """Remove the entries of directory ``where`` named with ``prefix`` whose owner process
    (``owner(name)``, None for an entry it does not claim) is gone; the number removed.

    ``remove(path)`` removes one; an entry another process removed first is not counted.
    """
    try:
        names = [n for n in os.listdir(where) if n.startswith(prefix)]
    except OSError:
        return 0
    removed = 0
    for name in names:
        pid = owner(name)
        if pid is not None and not pid_alive(pid):
            with contextlib.suppress(OSError):  # another process removed it first
                remove(os.path.join(where, name))
                removed += 1
    return removed
