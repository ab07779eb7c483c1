"""``Roles`` is a real read-only mapping: ``in``, ``len``, iteration, ``items()``, ``KeyError``."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import pytest

from dask_train.policy import Roles


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
