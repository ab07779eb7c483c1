"""The private APIs wrapped in :mod:`dask_train.runtime._compat` still exist with the shape we use.

Each wrapper exists because distributed or torch lacks a public API. The wrappers themselves are
forgiving at run time (``drop_topic_handler`` does nothing when ``_event_handlers`` is gone), so a
release that renames one would fail silently in production; these tests fail loudly instead, and
each message names the private attribute that changed and the public API still missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import distributed
import pytest
import torch
from distributed import Client, Worker, wait

from dask_train.data._cluster import live_workers
from dask_train.runtime import _compat
from dask_train.runtime._compat import (
    drop_topic_handler,
    pause_profiler,
    reset_torch_group_count,
    worker_data,
)

SRC = Path(__file__).resolve().parents[2] / "src"
_DISTRIBUTED = f"distributed {distributed.__version__}"
_TORCH = f"torch {torch.__version__}"


def _changed(private: str, missing_public: str, version: str) -> str:
    return (
        f"{version}: {private} changed shape. dask_train.runtime._compat uses it because there is "
        f"no public API to {missing_public}; update _compat (or use the public API if the new "
        "release adds one)."
    )


# --- Worker.data --------------------------------------------------------------------------------

_NO_READ = "read a result a worker holds in memory without running a task"


def _worker_holds(key: str, dask_worker: Worker) -> dict[str, Any]:
    # Runs inside the worker process (client.run passes the Worker as ``dask_worker``).
    data = worker_data(dask_worker)
    return {
        "type": type(data).__name__,
        "is_mapping": isinstance(data, MutableMapping),
        "has_key": key in data,
        "value": data[key] if key in data else None,
    }


def test_worker_data_holds_task_results(client: Client) -> None:
    address = sorted(live_workers(client))[0]
    future = client.submit(sum, [20, 22], workers=[address], pure=False)
    wait(future)
    try:
        seen = client.run(_worker_holds, future.key, workers=[address])[address]
    finally:
        del future
    assert seen["is_mapping"], _changed(
        f"Worker.data (now a {seen['type']}) is no MutableMapping", _NO_READ, _DISTRIBUTED
    )
    assert seen["has_key"] and seen["value"] == 42, _changed(
        "Worker.data no longer holds a finished task's result under its key", _NO_READ, _DISTRIBUTED
    )


# --- Worker.periodic_callbacks["profile"] ------------------------------------------------------

_NO_PAUSE = "pause a worker's statistical profiler (it is on or off for the worker's whole life)"


def _profiler_running(dask_worker: Worker) -> Any:
    callback = dask_worker.periodic_callbacks.get("profile")
    return None if callback is None else bool(callback.is_running())


def _pause_then(dask_worker: Worker) -> Any:
    return pause_profiler(dask_worker) is not None


def _resume(dask_worker: Worker) -> None:
    callback = dask_worker.periodic_callbacks["profile"]
    dask_worker.loop.add_callback(callback.start)


def test_the_profiler_is_a_periodic_callback_that_pauses(client: Client) -> None:
    address = sorted(live_workers(client))[0]
    # Running, once any role of an earlier test that paused it has ended there.
    assert _profiler_becomes(client, address, True), _changed(
        'Worker.periodic_callbacks["profile"] (the statistical profiler) is gone or not running',
        _NO_PAUSE, _DISTRIBUTED)
    try:
        assert client.run(_pause_then, workers=[address])[address] is True
        assert _profiler_becomes(client, address, False), _changed(
            "stopping the profiler's PeriodicCallback left it running", _NO_PAUSE, _DISTRIBUTED)
    finally:
        client.run(_resume, workers=[address])
    assert _profiler_becomes(client, address, True)


def _profiler_becomes(client: Client, address: str, running: bool) -> bool:
    """Whether the profiler's state becomes ``running`` within 10 s: stop and start are
    scheduled on the worker's event loop, and a full suite's loaded machine runs them late."""
    deadline = time.monotonic() + 10
    while client.run(_profiler_running, workers=[address])[address] is not running:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --- Client._event_handlers ---------------------------------------------------------------------

_NO_FORGET = "make a client forget an event handler (unsubscribe_topic keeps it)"


def test_event_handlers_follow_subscribe_and_drop(client: Client,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    topic = "dask-train-compat-test"
    monkeypatch.setattr(_compat, "LATE_EVENTS_S", 0.05)

    def handler(event: Any) -> None:  # never called: nothing is logged to the topic
        pass

    handlers = getattr(client, "_event_handlers", None)
    assert isinstance(handlers, dict), _changed(
        f"Client._event_handlers (now {type(handlers).__name__}) is no dict", _NO_FORGET, _DISTRIBUTED
    )
    client.subscribe_topic(topic, handler)
    try:
        assert client._event_handlers.get(topic) is handler, _changed(
            "Client.subscribe_topic no longer stores its handler in Client._event_handlers[topic]",
            _NO_FORGET,
            _DISTRIBUTED,
        )
        client.unsubscribe_topic(topic)
        # Today the handler stays after unsubscribe (the leak drop_topic_handler fixes); a release
        # that removes it is fine: dropping then does nothing.
        drop_topic_handler(client, topic)
        # At once a no-op takes the events still on their way; the topic goes soon after.
        assert client._event_handlers.get(topic) in (None, _compat._late_event)
        deadline = time.monotonic() + 10
        while topic in client._event_handlers and time.monotonic() < deadline:
            time.sleep(0.02)
        assert topic not in client._event_handlers, _changed(
            "drop_topic_handler left the handler in Client._event_handlers", _NO_FORGET, _DISTRIBUTED
        )
    finally:
        client._event_handlers.pop(topic, None)


# --- torch's c10d._world.group_count ------------------------------------------------------------

_NO_RESET = "reset the count of process groups after a failed init_process_group"


def test_group_count_is_a_settable_int() -> None:
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    assert world is not None, _changed("torch.distributed.distributed_c10d._world is gone", _NO_RESET, _TORCH)
    before = getattr(world, "group_count", None)
    assert isinstance(before, int), _changed(
        f"c10d._world.group_count (now {type(before).__name__}) is no int", _NO_RESET, _TORCH
    )
    try:
        world.group_count = 5
        assert world.group_count == 5, _changed(
            "setting c10d._world.group_count does not stick", _NO_RESET, _TORCH
        )
        reset_torch_group_count()
        assert world.group_count == 0, _changed(
            "reset_torch_group_count did not zero c10d._world.group_count", _NO_RESET, _TORCH
        )
    finally:
        world.group_count = before


def test_group_count_names_the_groups_init_creates() -> None:
    # The reason for the reset: init_process_group takes its group's name from the count and
    # raises it. Checked in a fresh interpreter: a process group is process-wide state.
    code = textwrap.dedent(
        """
        import json
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        from dask_train.runtime._compat import reset_torch_group_count

        before = c10d._world.group_count
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        after_init = c10d._world.group_count
        name = dist.group.WORLD.group_name
        dist.destroy_process_group()
        c10d._world.group_count = 7  # as a failed init would leave it raised
        reset_torch_group_count()
        print(json.dumps({"before": before, "after_init": after_init, "name": name,
                          "after_reset": c10d._world.group_count}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["after_init"] == seen["before"] + 1, _changed(
        f"init_process_group no longer raises c10d._world.group_count ({seen})", _NO_RESET, _TORCH
    )
    assert seen["name"] == str(seen["before"]), _changed(
        f"the default group is no longer named from c10d._world.group_count ({seen})", _NO_RESET, _TORCH
    )
    assert seen["after_reset"] == 0


# --- multiprocessing.spawn.get_preparation_data -------------------------------------------------

_NO_MAIN = "start a process without re-importing the parent's __main__ module"


def test_spawn_records_the_main_script_and_the_patch_leaves_it_out_for_dask_workers(
        tmp_path: Path) -> None:
    # In a fresh interpreter running a script: the preparation data of an ordinary child names
    # the script (the child re-runs it); that of a Dask worker process does not.
    script = tmp_path / "main_script.py"
    script.write_text(textwrap.dedent(
        """
        import json
        import multiprocessing.spawn as spawn
        from dask_train.runtime._compat import DASK_WORKER_PROCESS, start_workers_without_main

        start_workers_without_main()
        start_workers_without_main()  # idempotent
        plain = spawn.get_preparation_data("SomeOtherProcess")
        dask = spawn.get_preparation_data(DASK_WORKER_PROCESS)
        print(json.dumps({"plain": sorted(plain), "dask": sorted(dask)}))
        """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(SRC)})
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "init_main_from_path" in seen["plain"], _changed(
        f"spawn.get_preparation_data no longer records the main script ({seen['plain']})",
        _NO_MAIN, f"Python {sys.version.split()[0]}")
    assert "init_main_from_path" not in seen["dask"] and "sys_path" in seen["dask"]
    from distributed import nanny

    assert "DASK_WORKER_PROCESS" not in dir(nanny)  # the name is ours; check distributed's own:
    source = Path(nanny.__file__).read_text()
    assert 'name="Dask Worker process (from Nanny)"' in source, _changed(
        "the Nanny names its worker process otherwise", _NO_MAIN, _DISTRIBUTED)

