"""Files kept in the memory of Dask workers (``dask-train-workers://``, runtime/_worker_files.py):
the store a job without ``checkpoint=`` keeps its state in when its workers share no directory.

A real cluster of worker processes: a checkpoint written on one worker through the ordinary
checkpoint code is kept by every holder, read back on another worker and by the client, and
still read after a holder is SIGKILLed."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator

import dask
import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster
from fsspec.core import url_to_fs

import dask_train as dt
from dask_train.checkpoint import CheckpointConfig, CheckpointStore, load_tensors, save_tensors
from dask_train.data._cluster import live_workers
from dask_train.errors import InvalidInput
from dask_train.policy._settings import OptimizerSettings
from dask_train.runtime._plugin import PLUGIN_NAME, DaskTrainPlugin
from dask_train.runtime._worker_files import holders_for, register_protocol, url

register_protocol()


@pytest.fixture(scope="module")
def client3() -> Iterator[Client]:
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.register_plugin(DaskTrainPlugin(), name=PLUGIN_NAME)
        yield client


def _held(client: Client) -> dict[str, list[str]]:
    return client.run(lambda dask_worker: sorted(getattr(dask_worker, "dask_train_files", {})))


def _write_shard(path: str, seed: int) -> str:
    # On a worker, as a parameter server writes its shard (checkpoint._io through fsspec).
    return save_tensors({"w": torch.arange(6.0) * seed}, path, metadata={"seed": str(seed)})


def _read_shard(path: str) -> list[float]:
    return load_tensors(path)["w"].tolist()


def test_a_checkpoint_in_workers_memory_is_kept_by_every_holder_and_read_anywhere(
        client3: Client) -> None:
    workers = sorted(live_workers(client3))
    writer, holders = workers[0], workers[1:]
    store = CheckpointStore(CheckpointConfig(url("job-a"), storage_options={"holders": holders},
                                             keep=1))
    directory = store.directory(10, 0)
    path = store.shard_path(directory, 0)
    # Written by a worker that holds none of the files, read by another worker and here.
    client3.submit(_write_shard, path, 3, workers=[writer], pure=False).result()
    store.write_manifest(directory, {"shards": ["shard-0.safetensors"], "step": 10})
    assert client3.submit(_read_shard, path, workers=[workers[2]], pure=False).result() == \
        [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
    held = _held(client3)
    assert held[writer] == []
    assert all(held[h] == ["job-a/ckpt-000000000010-000/manifest.json",
                           "job-a/ckpt-000000000010-000/shard-0.safetensors"] for h in holders)
    # A newer checkpoint replaces it (keep=1): the store lists, finds and prunes as on a disk.
    newer = store.directory(20, 0)
    client3.submit(_write_shard, store.shard_path(newer, 0), 4, workers=[writer],
                   pure=False).result()
    store.write_manifest(newer, {"shards": ["shard-0.safetensors"], "step": 20})
    assert store.newest()[1]["step"] == 20
    store.prune()
    assert [d.rsplit("/", 1)[-1] for d in store.complete()] == ["ckpt-000000000020-000"]
    fs, root = url_to_fs(url("job-a"), holders=holders)
    fs.rm(root, recursive=True)
    assert not any(_held(client3).values())


def test_a_holder_killed_leaves_the_files_readable_from_the_other(client3: Client) -> None:
    workers = sorted(live_workers(client3))
    holders = workers[:2]
    fs, root = url_to_fs(url("job-b"), holders=holders)
    fs.pipe_file(f"{root}/state.bin", b"x" * 1000)
    pid = client3.run(os.getpid, workers=[holders[0]])[holders[0]]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while holders[0] in live_workers(client3) and time.monotonic() < deadline:
        time.sleep(0.1)
    # Read, listed and written with one holder left; nothing answers once both are gone.
    assert fs.cat_file(f"{root}/state.bin") == b"x" * 1000
    assert fs.ls(root, detail=False) == [f"{root}/state.bin"]
    fs.mv(f"{root}/state.bin", f"{root}/moved.bin")
    assert fs.exists(f"{root}/moved.bin") and not fs.exists(f"{root}/state.bin")
    gone = url_to_fs(url("job-b"), holders=[holders[0]])[0]
    with pytest.raises(OSError, match="none of the workers holding"):
        gone.cat_file(f"{root}/moved.bin")
    fs.rm(root, recursive=True)
    client3.wait_for_workers(3, timeout=60)  # the nanny restarts the killed one


async def _block_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # on the worker's event loop: nothing else of it runs meanwhile


def test_a_holder_that_does_not_answer_does_not_hold_up_a_write(client3: Client) -> None:
    # One holder's event loop is blocked (a worker busy on its loop, or hung): the write stands
    # on the other holder within GRACE_S of its answer, not after the call's whole timeout.
    from dask_train.runtime._worker_files import GRACE_S

    workers = sorted(live_workers(client3))
    stuck, fine = workers[0], workers[1]
    fs, root = url_to_fs(url("job-d"), holders=[stuck, fine], skip_instance_cache=True)
    client3.run(_block_the_loop, GRACE_S + 6, workers=[stuck], wait=False)
    time.sleep(0.5)
    t0 = time.monotonic()
    fs.pipe_file(f"{root}/state.bin", b"y" * 100)
    took = time.monotonic() - t0
    assert took < GRACE_S + 2.5, took
    assert fs.cat_file(f"{root}/state.bin") == b"y" * 100
    assert _held(client3)[fine] == ["job-d/state.bin"]
    fs.rm(root, recursive=True)


def test_a_holder_slow_to_answer_is_named_in_the_log(
        client3: Client, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # The only holder's loop is blocked for 2 s: the write waits for it (and succeeds), and the
    # wait is said after SLOW_S, naming the holder and the call: a job whose copy or hand-over
    # waits on a holder shows which one.
    from dask_train.runtime import _worker_files

    monkeypatch.setattr(_worker_files, "SLOW_S", 0.5)
    stuck = sorted(live_workers(client3))[0]
    fs, root = url_to_fs(url("job-e"), holders=[stuck], skip_instance_cache=True)
    client3.run(_block_the_loop, 2.0, workers=[stuck], wait=False)
    time.sleep(0.2)
    with caplog.at_level(logging.WARNING, logger="dask_train.runtime._worker_files"):
        fs.pipe_file(f"{root}/slow.bin", b"z" * 10)
    [record] = [r for r in caplog.records if "has not answered" in r.getMessage()]
    assert stuck in record.getMessage() and "'put' of job-e/slow.bin" in record.getMessage()
    assert fs.cat_file(f"{root}/slow.bin") == b"z" * 10
    fs.rm(root, recursive=True)


def test_a_shard_written_to_a_slow_holder_goes_on_training_meanwhile(client3: Client) -> None:
    # A server's shard encodes its file under its lock and writes it after: while the only
    # holder's loop is blocked, the write waits, but a pull and a push do not wait for it (held
    # through the write, the lock kept the scorer and the trainers waiting on the holder).
    import threading

    from dask_train.checkpoint import load_shard
    from dask_train.checkpoint._io import StoragePath
    from dask_train.engines.holders.optim import FlatOptimizer

    stuck = sorted(live_workers(client3))[0]
    options = {"holders": [stuck], "skip_instance_cache": True}
    path = StoragePath(url("job-f") + "/shard-0.safetensors", options)
    shard = FlatOptimizer(np.zeros(4, np.float32), OptimizerSettings("adam", 0.1, {}))
    client3.run(_block_the_loop, 3.0, workers=[stuck], wait=False)
    time.sleep(0.2)
    saved: list[dict[str, object]] = []
    writer = threading.Thread(target=lambda: saved.append(shard.save(path, metadata={})))
    writer.start()
    time.sleep(0.5)
    _, version, _, _ = shard.pull()
    shard.grad.fill_(1.0)
    shard.step(8)
    assert writer.is_alive(), "the pull and the push waited for the write to the slow holder"
    writer.join(timeout=60)
    assert saved and saved[0]["version"] == version == 0 and shard.version == 1
    state = load_shard(path)
    assert state.metadata["version"] == "0" and state.param.tolist() == [0.0] * 4
    url_to_fs(path, **options)[0].rm(url("job-f"), recursive=True)


def test_holders_are_the_kept_ones_then_workers_without_a_role() -> None:
    alive = ["tcp://a:1", "tcp://b:1", "tcp://c:1", "tcp://d:1"]
    assert holders_for(alive, roles=["tcp://a:1", "tcp://b:1"]) == ["tcp://c:1", "tcp://d:1"]
    assert holders_for(alive, roles=alive, keep=["tcp://gone:1", "tcp://d:1"]) == \
        ["tcp://d:1", "tcp://a:1"]
    assert holders_for([], roles=alive) == []


def test_bad_settings_are_named(client3: Client) -> None:
    with pytest.raises(InvalidInput, match="holders"):
        url_to_fs(url("job-c"), holders=[])
    X = da.from_array(np.zeros((100, 4), np.float32), chunks=50)
    y = da.from_array(np.zeros(100, np.int64), chunks=50)
    with dask.config.set({"dask-train.memory-state": "disk"}), \
            pytest.raises(InvalidInput, match="dask-train.memory-state='disk' is invalid"):
        dt.Trainer(torch.nn.Linear(4, 2), epochs=1, progress=False, client=client3).fit(X, y)
