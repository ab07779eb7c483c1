"""What a process holds, read from ``/proc/self``: descriptors by kind, the ``/dev/shm`` files
they keep open, threads, resident memory. The soak benchmark and the tests that guard "a job
leaves every worker as it found it" read the same record.

Why descriptors by kind and not ``ls /dev/shm``: a segment that was unlinked keeps its memory as
long as any descriptor (or mapping) of it is open, and nothing in the directory shows it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from typing import Any


def _kind(target: str) -> str:
    # "socket:[123]", "pipe:[4]", "anon_inode:[eventfd]", "/dev/shm/x (deleted)", "/path".
    if target.startswith("/dev/shm/"):
        return "shm"
    if target.startswith("/"):
        return "file"
    return target.split(":", 1)[0]


def process_resources(dask_worker: Any = None) -> dict[str, Any]:
    """This process's descriptors by kind (``socket``, ``pipe``, ``anon_inode``, ``file``,
    ``shm``), the ``/dev/shm`` names they hold (``shm_names``), mapped ``/dev/shm`` files
    (``shm_mapped``), ``threads`` (a count) and ``thread_names``, ``rss_mb``, and what the
    resident memory is made of on Python's side: ``modules`` imported and ``py_blocks``
    (memory blocks Python's allocator holds, ``sys.getallocatedblocks``). Runs as
    ``client.run(process_resources)`` (``dask_worker`` is Dask's, unused) or in the client."""
    fds: dict[str, int] = {}
    names: list[str] = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor of the listing itself, closed by now
            continue
        kind = _kind(target)
        fds[kind] = fds.get(kind, 0) + 1
        if kind == "shm":
            names.append(target[len("/dev/shm/"):])
    mapped = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                mapped.add(fields[5].strip())
    with open("/proc/self/statm") as statm:
        rss_pages = int(statm.read().split()[1])
    return {"fds": fds, "shm_names": sorted(names), "shm_mapped": sorted(mapped),
            "threads": threading.active_count(),
            "thread_names": sorted(t.name for t in threading.enumerate()),
            "modules": len(sys.modules), "py_blocks": sys.getallocatedblocks(),
            "rss_mb": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20}


def trim_malloc(dask_worker: Any = None) -> float:
    """Give the C allocator's free memory back to the system (glibc ``malloc_trim(0)``) and
    return the resident memory after it, in MB: what RSS holds beyond live objects shows as the
    difference (memory freed by Python and torch that the allocator keeps for reuse)."""
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
    return float(process_resources()["rss_mb"])


def scheduler_tasks(dask_scheduler: Any = None) -> int:
    """The number of tasks the scheduler knows (``client.run_on_scheduler``)."""
    return len(dask_scheduler.tasks)


def scheduler_topics(dask_scheduler: Any = None, prefix: str = "dask-train-") -> dict[str, int]:
    """The scheduler's event topics named ``prefix...`` and the events it keeps of them
    (``client.run_on_scheduler``; read from distributed's broker, ``{}`` where it has none)."""
    topics = getattr(getattr(dask_scheduler, "_broker", None), "_topics", None) or {}
    return {name: len(topic.events) for name, topic in list(topics.items())
            if name.startswith(prefix)}
