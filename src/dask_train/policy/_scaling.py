"""Scaling decisions: how long a restart waits for the cluster to get back to its size, and
whether a job that grows only in a new generation regroups onto workers that joined.

Pure functions over plain values (counts, flags): the controller reads the cluster, asks, and
carries the answer out (``GenerationPlacement.after_loss``, ``Liveness._take_arrivals``).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The longest a restart waits for lost workers to come back (a nanny restarts a killed worker
#: in about a second, and the new generation should use it).
RESTART_WAIT_S = 10.0


@dataclass(frozen=True)
class RestartWait:
    """What a restart waits for: ``workers`` live (0: none), for at most ``seconds``."""

    workers: int
    seconds: float


def restart_wait(*, most_seen: int, reserved: bool, retired: bool,
                 timeout: float) -> RestartWait:
    """How many live workers a restart waits for, and how long at most.

    ``most_seen`` is the most workers seen alive in the job (not the lost roles' addresses plus
    the live ones, which counted a worker the nanny had already restarted); ``reserved``: the
    job runs on workers reserved for it (a search's trial), which never sees a new one;
    ``retired``: every lost worker left with notice, so none comes back (a sync job stopped as
    rank 0 retired once waited the whole time for it).

    Examples
    --------
    >>> restart_wait(most_seen=3, reserved=False, retired=False, timeout=60.0)
    RestartWait(workers=3, seconds=10.0)
    >>> restart_wait(most_seen=3, reserved=False, retired=True, timeout=5.0)
    RestartWait(workers=0, seconds=5.0)
    """
    workers = 0 if reserved or retired else max(0, int(most_seen))
    return RestartWait(workers=workers, seconds=min(RESTART_WAIT_S, float(timeout)))


def may_regroup(*, grows_by_regroup: bool, running: bool, stopping: bool,
                handing_over: bool, leaving: bool) -> bool:
    """Whether a job may regroup onto workers that joined now: an engine that takes them in
    only in a new generation (``grows_by_regroup``: a ``Regrouping`` engine, sync ranks and
    ``dt.run``), running (not in a checkpoint's pause, some trainer still taking part), with no
    stop decided, no hand-over under way and no worker of its roles leaving."""
    return grows_by_regroup and running and not (stopping or handing_over or leaving)


def regroup_wanted(*, current_trainers: int, planned_trainers: int) -> bool:
    """Whether the placement on the live workers would give the job more trainers than it has:
    a regroup costs a hand-over, worth it only for trainers gained."""
    return planned_trainers > current_trainers
