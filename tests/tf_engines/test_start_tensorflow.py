"""``dt.start_tensorflow``: TensorFlow servers inside Dask workers, torn down by restarting them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import Client

import dask_train as dt
from dask_train.data._cluster import live_workers
from dask_train.policy import plan_roles
from dask_train.tensorflow import _server
from dask_train.tensorflow._start import _wait

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tensorflow_digits.py"


def _tf_config() -> dict | None:
    text = os.environ.get("TF_CONFIG")
    return json.loads(text) if text else None


def _listening(target: str) -> bool:
    host, port = target.rsplit(":", 1)
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex((host.strip("[]"), int(port))) == 0


def _workers(client: Client) -> dict[str, int]:
    return {a: int(w["nthreads"]) for a, w in live_workers(client).items()}


def test_start_close_and_start_again(tf_client: Client) -> None:
    before = _workers(tf_client)
    cluster = dt.start_tensorflow(tf_client, ps=1, worker=2, scorer=1, timeout=240)
    tf_spec, dask_spec = cluster
    assert tf_spec.as_dict() == cluster.spec
    assert {k: len(v) for k, v in cluster.spec.items()} == {"worker": 2, "ps": 1, "scorer": 1}
    # Placed by the pure policy on the live workers; the servers are on those workers' hosts.
    # (TensorFlow's task type for a trainer is "worker".)
    placed = plan_roles(before, ps=1, worker=2, scorer=1)
    assert dask_spec == {"worker": placed["trainer"], "ps": placed["ps"], "scorer": placed["scorer"]}
    targets = [t for role in ("worker", "ps", "scorer") for t in cluster.spec[role]]
    assert len({t.rsplit(":", 1)[1] for t in targets}) == 4  # four ports, from the OS
    for role, addrs in dask_spec.items():
        for target, address in zip(cluster.spec[role], addrs):
            assert target.rsplit(":", 1)[0] == address.split("://")[1].rsplit(":", 1)[0]
    assert all(_listening(t) for t in targets)
    # TF_CONFIG: each process names its first role; a task submitted for a role sees that role.
    configs = tf_client.run(_tf_config)
    assert configs[dask_spec["worker"][0]]["task"] == {"type": "worker", "index": 0}
    assert configs[dask_spec["worker"][1]]["task"] == {"type": "worker", "index": 1}
    assert all(c["cluster"] == cluster.spec for c in configs.values())
    got = cluster.submit(_tf_config, role="ps").result(timeout=60)
    assert got == {"cluster": cluster.spec, "task": {"type": "ps", "index": 0}}
    # A second start on the same workers is refused before anything runs.
    with pytest.raises(dt.InvalidInput, match="close"):
        dt.start_tensorflow(tf_client, ps=1, worker=1, scorer=0)

    cluster.close()
    after = _workers(tf_client)
    assert len(after) == len(before) and not set(after) & set(before)  # restarted, all back
    assert not any(_listening(t) for t in targets)  # the servers died with their processes
    cluster.close()  # twice: nothing more

    with dt.start_tensorflow(tf_client, ps=1, worker=1, scorer=0, timeout=240) as again:
        assert set(again.dask_spec["worker"]) <= set(after)
        assert all(_listening(t) for role in again.spec.values() for t in role)
    assert again.closed
    assert not any(tf_client.run(_server.holders).values())


def _busy(seconds: float) -> None:
    time.sleep(seconds)


def test_a_server_that_cannot_start_fails_within_the_timeout(tf_client: Client) -> None:
    workers = sorted(_workers(tf_client))
    placement = plan_roles(_workers(tf_client), ps=1, worker=2, scorer=1)
    blocked = placement["trainer"][1]
    # Holds the blocked worker's only thread past the start's timeout (3 s), so its roles' tasks
    # never start in time.
    busy = tf_client.submit(_busy, 5, workers=[blocked], pure=False)
    while not tf_client.processing(workers=[blocked])[blocked]:
        time.sleep(0.05)
    started = time.monotonic()
    with pytest.raises(dt.TrainingTimeout) as info:
        dt.start_tensorflow(tf_client, ps=1, worker=2, scorer=1, timeout=3)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert elapsed < 3 + 15  # the timeout, plus tearing down what had started
    assert blocked in message and "worker-1" in message and "scorer-0" in message
    assert "within 3 s" in message
    busy.result(timeout=60)
    # The tasks of the abandoned start that ran late started nothing, so nothing was restarted.
    assert sorted(_workers(tf_client)) == workers
    assert not any(tf_client.run(_server.holders).values())


def test_bad_arguments_are_refused_before_anything_runs(tf_client: Client) -> None:
    with pytest.raises(dt.InvalidInput) as info:
        dt.start_tensorflow(tf_client, ps=-1, worker=0, scorer=2, timeout=0)
    text = str(info.value)
    assert "ps=-1" in text and "workers=0" in text and "scorer=2" in text and "timeout=0" in text


def test_the_start_waits_through_the_given_client(own_client: Client) -> None:
    # In a process with no default client, where distributed.wait would find none. Plain tasks
    # stand in for the servers' (the wait is the same, without TensorFlow's start-up).
    on = {"a": [("worker", 0)], "b": [("worker", 1)]}
    fine = {k: own_client.submit(abs, -1, pure=False) for k in on}
    _wait(own_client, fine, timeout=30, what="start", on=on, where=str)
    failing = {"a": fine["a"], "b": own_client.submit(divmod, 1, 0, pure=False)}
    with pytest.raises(dt.RoleFailed) as info:
        _wait(own_client, failing, timeout=30, what="start", on=on, where=str)
    assert "worker-1 on b: could not start: ZeroDivisionError" in str(info.value)


def test_the_example_reproduces_the_original_workflow(tf_client: Client) -> None:
    scheduler = tf_client.scheduler.address
    # Batches of 1024 at lr 0.03, to 0.9: a few hundred steps instead of the defaults' 3,500
    # steps of 128 to 0.95; the coordinator dispatches each step, so the steps set the time, and
    # on a loaded machine each dispatch waits its turn (once 218 s to 0.95 here, 600-1,800 steps).
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--scheduler", scheduler, "--n-samples", "200000",
         "--seconds", "240", "--batch-size", "1024", "--lr", "0.03", "--target", "0.9"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(dt.__file__).parents[1])})
    log = proc.stdout + proc.stderr
    print(proc.stdout)  # its timings and steps, shown with the test's output
    assert proc.returncode == 0, log
    lines = dict(line.split(None, 1) for line in proc.stdout.splitlines()
                 if line and not line.startswith(("tf_spec", "dask_spec", "dask-train")))
    assert float(lines["held_out_accuracy"]) >= 0.9, log
    assert lines["stopped_by_scorer"].strip() == "True"
    assert json.loads(lines["scorer_role"].replace("'", '"')) == {"type": "scorer", "index": 0}
    assert "Traceback" not in log and "ERROR" not in log and "E0000" not in log, log
