"""The scaling decisions (policy/_scaling.py), without a cluster."""

from __future__ import annotations

import itertools

import pytest

from dask_train.policy._scaling import (
    RESTART_WAIT_S,
    RestartWait,
    may_regroup,
    regroup_wanted,
    restart_wait,
)


@pytest.mark.parametrize(("reserved", "retired", "workers"), [
    (False, False, 3),  # a nanny brings a killed worker back: wait for the cluster's size
    (True, False, 0),  # a search's trial never sees a new worker
    (False, True, 0),  # a retired worker does not come back
    (True, True, 0),
])
def test_a_restart_waits_for_the_most_workers_seen_unless_none_comes_back(
        reserved: bool, retired: bool, workers: int) -> None:
    wait = restart_wait(most_seen=3, reserved=reserved, retired=retired, timeout=60.0)
    assert wait == RestartWait(workers=workers, seconds=RESTART_WAIT_S)


def test_a_restart_waits_no_longer_than_the_jobs_timeout() -> None:
    assert restart_wait(most_seen=2, reserved=False, retired=False, timeout=3.0).seconds == 3.0
    assert restart_wait(most_seen=2, reserved=False, retired=False, timeout=600).seconds == 10.0


def test_a_regroup_needs_every_condition() -> None:
    allowed = dict(grows_by_regroup=True, running=True, stopping=False, handing_over=False,
                   leaving=False)
    assert may_regroup(**allowed)
    for name in allowed:  # any one condition turned makes it wait
        assert not may_regroup(**{**allowed, name: not allowed[name]}), name
    flags = itertools.product([False, True], repeat=5)
    assert sum(may_regroup(**dict(zip(allowed, f))) for f in flags) == 1


@pytest.mark.parametrize(("current", "planned", "wanted"),
                         [(2, 3, True), (2, 2, False), (3, 2, False), (1, 4, True)])
def test_a_regroup_is_wanted_only_for_trainers_gained(current: int, planned: int,
                                                      wanted: bool) -> None:
    assert regroup_wanted(current_trainers=current, planned_trainers=planned) is wanted
