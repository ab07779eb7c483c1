"""A job's in-memory copies of its state: whether it keeps them, and where.

A job whose servers hold the only copy of its state keeps a copy of it in memory every few
seconds while it has no checkpoint, so that a killed server costs seconds, not the run. Where:
memory that no single worker's death takes, a directory of this machine's ``/dev/shm`` when
every worker of the job runs on this machine, else the memory of two live workers. The same
choice places a hand-over's state for a job without ``checkpoint=``.

The controller reads the Dask config (``dask-train.copy-every``, ``dask-train.memory-state``)
once, where the job's spec is built, and the worker hosts at its edge; the rules here take the
values.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable

#: How often a job without ``checkpoint=`` keeps a copy of its state in memory (seconds): a
#: killed parameter server costs at most this much training. The Dask config
#: ``dask-train.copy-every`` (seconds; 0: no copies) sets it.
COPY_EVERY_S = 5.0

#: Where a job without ``checkpoint=`` keeps the state it may need after a loss or a regroup
#: (Dask config ``dask-train.memory-state``): ``"auto"``, a directory of this machine's
#: ``/dev/shm`` when every worker of the job runs on this machine, else the memory of two live
#: workers; ``"workers"``, always the workers' memory (for workers in containers of one host
#: that do not share ``/dev/shm``).
MEMORY_STATE = ("auto", "workers")


def memory_state_problems(value: object) -> list[str]:
    """What is wrong with a value of ``dask-train.memory-state`` (empty when valid).

    Examples
    --------
    >>> memory_state_problems("workers")
    []
    >>> len(memory_state_problems("disk"))
    1
    """
    if value in MEMORY_STATE:
        return []
    return [f"dask config dask-train.memory-state={value!r} is invalid: use 'auto' (this "
            "machine's /dev/shm when every worker is on it, else the workers' memory) or "
            "'workers' (always the workers' memory)."]


def copies_wanted(every_s: float, *, schedules_checkpoints: bool, recovers_from_survivors: bool,
                  has_checkpoint_store: bool, checkpointed: bool) -> bool:
    """Whether a job keeps copies of its state in memory this generation.

    Only a job that could otherwise only restart from its initial parameters does: not with
    copies off (``every_s <= 0``); not an engine paused for checkpoints whose trainers hold the
    state themselves (sync ranks: every rank holds the same state); with ``checkpoint=`` set
    (``has_checkpoint_store``), only an engine the controller pauses for checkpoints and until
    its first checkpoint is written (``checkpointed``: a server killed before it would otherwise
    cost more with checkpoints on than off). An engine whose ranks report their state
    (``dt.run``: not ``schedules_checkpoints``, a ``Reporting`` engine) keeps copies of its reports without
    ``checkpoint=``; with it, each report's state is written there.

    Parameters
    ----------
    every_s : float
        ``dask-train.copy-every``: seconds between copies, 0 for none.
    schedules_checkpoints, recovers_from_survivors : bool
        Whether the controller pauses the engine for checkpoints (it is no ``Reporting``
        engine), and whether its surviving trainers hold the state (a ``Survivable`` one).
    has_checkpoint_store : bool
        Whether the job has ``checkpoint=``.
    checkpointed : bool
        Whether ``checkpoint=``'s store holds a checkpoint of this job (written or resumed from).

    Examples
    --------
    >>> copies_wanted(5.0, schedules_checkpoints=True, recovers_from_survivors=False,
    ...               has_checkpoint_store=False, checkpointed=False)
    True
    """
    if every_s <= 0 or schedules_checkpoints and recovers_from_survivors:
        return False
    return not (has_checkpoint_store and (not schedules_checkpoints or checkpointed))


class MemoryPlace(enum.Enum):
    """Where state kept in memory goes."""

    MACHINE = "machine"  # a directory of this machine's /dev/shm, which every worker reaches
    WORKERS = "workers"  # each file in two live workers' memory


def on_one_machine(hosts: Iterable[str], here: Collection[str]) -> bool:
    """Whether every worker host is one of this machine's addresses (``here``).

    Examples
    --------
    >>> on_one_machine(["127.0.0.1", "10.0.0.2"], {"127.0.0.1", "10.0.0.2"})
    True
    >>> on_one_machine(["10.0.0.3"], {"127.0.0.1"})
    False
    """
    return all(host in here for host in hosts)


def memory_place(memory_state: str, *, hosts: Iterable[str], here: Collection[str]) -> MemoryPlace:
    """Where a job keeps state in memory: this machine's ``/dev/shm`` when ``memory_state`` is
    ``"auto"`` and every worker host is this machine, else the workers' memory.

    Parameters
    ----------
    memory_state : {"auto", "workers"}
        ``dask-train.memory-state`` (:data:`MEMORY_STATE`).
    hosts : iterable of str
        The hosts of the job's workers (those in this process left out).
    here : collection of str
        This machine's addresses.

    Examples
    --------
    >>> memory_place("auto", hosts=["127.0.0.1"], here={"127.0.0.1"})
    <MemoryPlace.MACHINE: 'machine'>
    >>> memory_place("workers", hosts=["127.0.0.1"], here={"127.0.0.1"})
    <MemoryPlace.WORKERS: 'workers'>
    """
    if memory_state == "auto" and on_one_machine(hosts, here):
        return MemoryPlace.MACHINE
    return MemoryPlace.WORKERS
