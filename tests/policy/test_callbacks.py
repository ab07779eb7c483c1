"""Callbacks: no-op hooks, stop requests as return values, and History."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from dask_train.errors import InvalidInput
from dask_train.policy.callbacks import HOOKS, Callback, History, run_callbacks


class Recorder(Callback):
    """Logs every call and answers ``stop_on_score`` / ``stop_on_epoch`` from hooks."""

    def __init__(
        self, name: str, log: list[str], *, stop_on_score: Any = None, stop_on_epoch: Any = None
    ) -> None:
        self.name = name
        self.log = log
        self.stop_on_score = stop_on_score
        self.stop_on_epoch = stop_on_epoch

    def on_fit_start(self, info: Mapping[str, Any]) -> None:
        self.log.append(f"{self.name}.start")

    def on_score(self, record: Mapping[str, Any]) -> bool | None:
        self.log.append(f"{self.name}.score")
        return self.stop_on_score

    def on_epoch_end(self, epoch: int, record: Mapping[str, Any] | None) -> bool | None:
        self.log.append(f"{self.name}.epoch{epoch}")
        return self.stop_on_epoch

    def on_fit_end(self, result: Any) -> None:
        self.log.append(f"{self.name}.end")


def test_base_callback_hooks_are_no_ops() -> None:
    cb = Callback()
    assert cb.on_fit_start({"workers": 2}) is None
    assert cb.on_score({"loss": 1.0}) is None
    assert cb.on_epoch_end(0, None) is None
    assert cb.on_fit_end(object()) is None


def test_run_callbacks_without_stop_requests() -> None:
    log: list[str] = []
    cbs = [Recorder("a", log), Recorder("b", log, stop_on_score=False)]
    assert run_callbacks(cbs, "on_fit_start", {}) is False
    assert run_callbacks(cbs, "on_score", {"loss": 1.0}) is False
    assert run_callbacks(cbs, "on_epoch_end", 0, None) is False
    assert run_callbacks(cbs, "on_fit_end", None) is False
    assert log == [
        "a.start",
        "b.start",
        "a.score",
        "b.score",
        "a.epoch0",
        "b.epoch0",
        "a.end",
        "b.end",
    ]


def test_run_callbacks_stop_request_still_calls_every_callback() -> None:
    log: list[str] = []
    cbs = [Recorder("a", log, stop_on_score=True), Recorder("b", log)]
    assert run_callbacks(cbs, "on_score", {"loss": 1.0}) is True
    assert log == ["a.score", "b.score"]


def test_run_callbacks_epoch_stop_request() -> None:
    log: list[str] = []
    cbs = [Recorder("a", log), Recorder("b", log, stop_on_epoch=True)]
    assert run_callbacks(cbs, "on_epoch_end", 3, {"loss": 0.5}) is True
    assert run_callbacks(cbs, "on_score", {"loss": 0.5}) is False
    assert log == ["a.epoch3", "b.epoch3", "a.score", "b.score"]


def test_run_callbacks_accepts_truthy_numpy_bool() -> None:
    cbs = [Recorder("a", [], stop_on_score=np.bool_(True))]
    assert run_callbacks(cbs, "on_score", {}) is True


def test_run_callbacks_empty_list() -> None:
    assert run_callbacks([], "on_score", {"loss": 1.0}) is False


def test_run_callbacks_rejects_unknown_hook() -> None:
    with pytest.raises(InvalidInput, match=r"hook='on_batch' is invalid: use one of on_fit_start"):
        run_callbacks([Callback()], "on_batch")
    assert HOOKS == ("on_fit_start", "on_score", "on_stats", "on_epoch_end", "on_fit_end",
                     "on_fit_error")


def test_run_callbacks_propagates_callback_errors() -> None:
    class Broken(Callback):
        def on_score(self, record: Mapping[str, Any]) -> bool | None:
            raise RuntimeError("bug in user callback")

    with pytest.raises(RuntimeError, match="bug in user callback"):
        run_callbacks([Broken()], "on_score", {})


def test_history_keeps_copies_of_records_in_order() -> None:
    history = History()
    history.on_fit_start({"strategy": "sync"})
    record = {"step": 1, "loss": 2.0}
    assert run_callbacks([history], "on_score", record) is False
    record["loss"] = 99.0  # the controller may reuse its dict
    run_callbacks([history], "on_score", {"step": 2, "loss": 1.5})
    run_callbacks([history], "on_epoch_end", 0, {"step": 2, "loss": 1.5})
    run_callbacks([history], "on_fit_end", "result")
    assert history.records == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    assert history.epochs == [0]
    assert history.info == {"strategy": "sync"}
    assert history.result == "result"


def test_history_is_cleared_at_fit_start() -> None:
    history = History()
    history.on_fit_start({})
    history.on_score({"step": 1})
    history.on_epoch_end(0, None)
    history.on_fit_end("first")
    history.on_fit_start({"run": 2})
    assert history.records == []
    assert history.epochs == []
    assert history.result is None
    assert history.info == {"run": 2}


def test_history_never_asks_to_stop() -> None:
    history = History()
    assert history.on_score({"loss": 1.0}) is None
    assert history.on_epoch_end(0, None) is None
