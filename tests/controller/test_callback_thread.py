"""User callbacks run off the client's event loop, in order, on a real cluster: a hook may block
while the job goes on scoring and stopping, and a hook may use the client."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import dask_train as dt


def count_up(ctx, pause=0.05):
    """Reports as fast as the job takes them, until it stops."""
    i = 0
    while not ctx.should_stop():
        time.sleep(pause)
        i += 1
        ctx.report({"i": i})
    return i


class Slow(dt.Callback):
    """Sleeps 1 s in each of its first three scores (3 s behind a job of 2 s)."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.threads: set[str] = set()

    def on_score(self, record):
        self.threads.add(threading.current_thread().name)
        if len(self.events) < 3:
            time.sleep(1.0)
        self.events.append(record["i"])

    def on_fit_end(self, result):
        self.events.append("end")


def test_a_slow_callback_holds_up_neither_the_scores_nor_the_stop(client):
    slow = Slow()
    result = dt.run(count_up, workers=2, client=client, callbacks=[slow],
                    stop=[dt.StopAfter(seconds=2)])
    assert result.stopped_by.startswith("StopAfter")
    # Run on the loop, the three 1 s sleeps would have let at most 3 reports through in 2 s (a
    # report every 0.05 s lets about 40 through).
    assert len(result.history) >= 6, result.history
    # Every score reached the hook, in order, and on_fit_end only after the last of them.
    assert slow.events == [*result.history["i"].astype(int), "end"]
    assert all(name.startswith("dask-train-callbacks") for name in slow.threads)
    # Every rank stopped after the same report.
    assert result.returns[0] == result.returns[1] == len(result.history)


class UsesTheClient(dt.Callback):
    def __init__(self, client) -> None:
        self.client = client
        self.pids: list[Any] = []
        self.sums: list[Any] = []

    def on_score(self, record):
        self.pids.append(self.client.run(os.getpid))
        self.sums.append(self.client.submit(sum, [record["i"], 1], pure=False).result())
        return record["i"] >= 3  # stops the job


def test_a_callback_may_use_the_client_and_stop_the_job(client):
    hook = UsesTheClient(client)
    result = dt.run(count_up, workers=2, client=client, callbacks=[hook], config={"pause": 0.2},
                    stop=[dt.StopAfter(seconds=60)])
    assert result.stopped_by == "callback"
    assert hook.pids and all(isinstance(p, dict) and len(p) == 2 for p in hook.pids)
    assert hook.pids[0] == client.run(os.getpid)
    assert hook.sums == [i + 1 for i in result.history["i"].astype(int)]
    # The stop comes at the controller's next pass, after the report that asked for it.
    assert len(result.history) >= 3


def test_a_failed_job_tells_its_callbacks_once_the_hooks_queued_before_ran() -> None:
    from dask_train.controller._hook_thread import CallbackThread, job_failed
    from dask_train.controller._state import JobLog

    class Heard(dt.Callback):
        def __init__(self) -> None:
            self.heard: list[Any] = []

        def on_score(self, record: Any) -> None:
            time.sleep(0.2)  # still running as the job fails
            self.heard.append(record["step"])

        def on_fit_error(self, error: BaseException, partial: Any) -> None:
            self.heard.append((error, partial))

    heard = Heard()
    thread, log, error = CallbackThread([heard]), JobLog(), RuntimeError("boom")
    log.records.append({"step": 1})
    thread.call("on_score", {"step": 1})
    job_failed([heard], error, thread=thread, log=log)
    assert heard.heard == [1, (error, {"records": [{"step": 1}], "checkpoints": [],
                                       "failures": []})]
    job_failed([heard], error)  # before the controller was made: nothing recorded yet
    assert heard.heard[-1] == (error, {"records": [], "checkpoints": [], "failures": []})
