"""``Roles`` is a real read-only mapping: ``in``, ``len``, iteration, ``items()``, ``KeyError``."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import pytest

from dask_train.errors import InvalidInput
from dask_train.policy import Roles, plan_roles


def test_roles_is_a_mapping_and_in_answers_at_once() -> None:
    roles = Roles({"ps": ["tcp://a:1"], "worker": ["tcp://a:1", "tcp://b:2"], "scorer": []})
    answers: list[bool] = []
    # "ps" in roles once looped forever (a __getitem__ that answered [] for any key); a thread
    # with a join timeout turns a hang into a failure instead of a stuck suite.
    probe = threading.Thread(target=lambda: answers.extend(["ps" in roles, "chief" in roles]))
    probe.start()
    probe.join(timeout=5)
    assert answers == [True, False]
    assert isinstance(roles, Mapping)
    # "worker", the seed's name for trainers (start_roles(worker=2)), reads as "trainer".
    assert len(roles) == 3 and list(roles) == ["ps", "trainer", "scorer"]
    assert dict(roles.items()) == {"ps": ["tcp://a:1"], "trainer": ["tcp://a:1", "tcp://b:2"],
                                   "scorer": []}
    assert roles["worker"] == roles["trainer"] and "worker" in roles
    assert roles.get("chief", []) == []
    with pytest.raises(KeyError):
        roles["chief"]


def test_roles_are_read_only_and_replace_returns_a_copy() -> None:
    roles = Roles({"trainer": ["a"], "scorer": ["a"]})
    roles["trainer"].append("b")  # a copy: the placement is unchanged
    moved = roles.replace("scorer", ["b"])
    assert roles["trainer"] == ["a"] and roles["scorer"] == ["a"] and moved["scorer"] == ["b"]
    assert moved == Roles({"worker": ["a"], "scorer": ["b"]}) and moved != roles
    assert moved.addresses == ["a", "b"] and moved.names_on("a") == ["trainer-0"]


def test_resources_put_trainers_only_where_declared_and_servers_off_them():
    from dask_train.policy._placement import Placement

    gpu = Placement.of({"GPU": 1})
    declared = {"a": {}, "b": {"GPU": 2}, "c": {"GPU": 1}, "d": {"GPU": 0.5}}
    slots = gpu.slots(declared)
    assert slots == {"b": 2, "c": 1}
    placed = plan_roles({w: 1 for w in declared}, ps=2, worker=3, scorer=1, slots=slots)
    assert sorted(placed["trainer"]) == ["b", "b", "c"]
    # Servers and the scorer hold no GPU: the least-loaded workers, those without trainers.
    assert set(placed["ps"]) | set(placed["scorer"]) <= {"a", "d"}
    with pytest.raises(InvalidInput, match="hold 3 trainers"):
        plan_roles({w: 1 for w in declared}, ps=0, worker=4, scorer=0, slots=slots)
    assert gpu.usable({"a": 1, "c": 4}, declared) == {"c": 4}
    with pytest.raises(InvalidInput, match=r"resources=\{'GPU': 1\}: workers=2 needs 2"):
        gpu.usable_for({"a": 1, "c": 4}, declared, need=2, what="workers=2")


def test_no_resources_is_every_worker_and_bad_values_are_named():
    from dask_train.policy._placement import Placement, resource_problems

    none = Placement.of(None)
    assert not none and none.task_resources is None
    assert none.usable({"a": 1, "b": 2}, {}) == {"a": 1, "b": 2}
    assert Placement.of({"GPU": np.int64(1)}).task_resources == {"GPU": 1.0}
    assert resource_problems({"GPU": 1, "MEM": 2.5}) == []
    for bad in ({"GPU": 0}, {"GPU": -1}, {"GPU": float("nan")}, {"GPU": "1"}, {"": 1}, [1],
                "GPU=1", {"GPU": True}):
        [problem] = resource_problems(bad)
        assert problem.startswith(f"resources={bad!r}"[:12]) and "{'GPU': 1}" in problem
    with pytest.raises(InvalidInput, match="GPU=0 is not a finite number > 0"):
        Placement.of({"GPU": 0})
