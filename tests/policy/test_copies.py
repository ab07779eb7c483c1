"""Whether a job keeps in-memory copies of its state, and where state kept in memory goes."""

from __future__ import annotations

import pytest

from dask_train.policy._copies import (
    COPY_EVERY_S,
    MEMORY_STATE,
    MemoryPlace,
    copies_wanted,
    memory_place,
    memory_state_problems,
    on_one_machine,
)

WANTED = [
    # every_s, schedules_checkpoints, recovers_from_survivors, has_store, checkpointed -> wanted
    (5.0, True, False, False, False, True),  # async-ps without checkpoint=
    (5.0, True, False, True, False, True),  # async-ps until checkpoint='s first is written
    (5.0, True, False, True, True, False),  # ... then not
    (0.0, True, False, False, False, False),  # copies off
    (-1.0, True, False, False, False, False),
    (5.0, True, True, False, False, False),  # sync ranks: every rank holds the state
    (5.0, True, True, True, False, False),
    (5.0, False, True, False, False, True),  # dt.run without checkpoint=: its reports' copies
    (5.0, False, True, True, False, False),  # dt.run with checkpoint=: its reports go there
    (5.0, False, False, True, True, False),
    (0.0, False, True, False, False, False),
]


@pytest.mark.parametrize(("every", "schedules", "recovers", "has_store", "checkpointed", "wanted"),
                         WANTED)
def test_copies_wanted(every: float, schedules: bool, recovers: bool, has_store: bool,
                       checkpointed: bool, wanted: bool) -> None:
    assert copies_wanted(every, schedules_checkpoints=schedules, recovers_from_survivors=recovers,
                         has_checkpoint_store=has_store, checkpointed=checkpointed) is wanted


def test_copies_are_on_by_default() -> None:
    assert COPY_EVERY_S > 0


HERE = {"127.0.0.1", "10.0.0.1"}

PLACES = [
    # memory_state, hosts -> place
    ("auto", ["127.0.0.1", "10.0.0.1"], MemoryPlace.MACHINE),
    ("auto", [], MemoryPlace.MACHINE),  # every worker in this process
    ("auto", ["127.0.0.1", "10.0.0.2"], MemoryPlace.WORKERS),  # one on another machine
    ("workers", ["127.0.0.1"], MemoryPlace.WORKERS),  # always the workers' memory
    ("workers", ["10.0.0.2"], MemoryPlace.WORKERS),
]


@pytest.mark.parametrize(("state", "hosts", "place"), PLACES)
def test_memory_place(state: str, hosts: list[str], place: MemoryPlace) -> None:
    assert memory_place(state, hosts=hosts, here=HERE) is place


@pytest.mark.parametrize(("hosts", "one"), [(["10.0.0.1"], True), ([], True),
                                            (["10.0.0.1", "192.168.1.5"], False)])
def test_on_one_machine(hosts: list[str], one: bool) -> None:
    assert on_one_machine(hosts, HERE) is one


@pytest.mark.parametrize("value", MEMORY_STATE)
def test_memory_state_values(value: str) -> None:
    assert memory_state_problems(value) == []


@pytest.mark.parametrize("value", ["disk", None, 1, "Auto"])
def test_memory_state_problems(value: object) -> None:
    [problem] = memory_state_problems(value)
    assert f"dask-train.memory-state={value!r} is invalid" in problem
    assert "'auto'" in problem and "'workers'" in problem
