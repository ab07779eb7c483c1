"""Denormals flushed where dask-train computes (``runtime._denormals``): the thread's FTZ/DAZ
flags, and those of torch's intra-op (OpenMP) threads, set while a role runs and as they were after
it; the Dask config ``dask-train.flush-denormal: false`` leaves them alone. Real torch, real
worker processes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster

import dask_train as dt
from dask_train.runtime._denormals import call_flushed, flushed, flushing

#: Elements of the probe product: enough that torch splits it over every intra-op thread.
_PROBE = 2_000_000


def denormals_made() -> int:
    """How many float32 denormals a product computed on this thread's intra-op team makes
    (counted on the bits: DAZ would make a float comparison see them as 0)."""
    bits = (torch.full((_PROBE,), 1e-30) * 1e-10).view(torch.int32)
    return int(((bits & 0x7F800000) == 0).sum() - (bits == 0).sum())


def report() -> dict[str, Any]:
    """This thread's flag and its team's: what a role's math runs with."""
    return {"thread": flushing(), "denormals": denormals_made(), "threads": torch.get_num_threads(),
            "ident": threading.get_ident()}


@pytest.fixture(scope="module")
def denormal_client() -> Iterator[Client]:
    """A cluster of this module's own: its workers are given two intra-op threads, which the
    session's cluster must not keep for the tests after these."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    denormals_made()  # the team exists, made with the flags off: only the team call reaches it
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_flushed_sets_the_thread_and_its_intra_op_team_and_restores_them(two_threads: None) -> None:
    assert not flushing() and denormals_made() == _PROBE
    # torch's own call reaches only the calling thread: the other thread's half stays denormal.
    torch.set_flush_denormal(True)
    try:
        partial = denormals_made()
    finally:
        torch.set_flush_denormal(False)
    assert 0 < partial < _PROBE
    with flushed(True) as on:
        assert on and flushing() and denormals_made() == 0
        with flushed(True):
            assert denormals_made() == 0
        assert flushing() and denormals_made() == 0  # the inner block restored nothing
    assert not flushing() and denormals_made() == _PROBE


def test_a_thread_already_flushing_stays_so(two_threads: None) -> None:
    with flushed(True):
        with flushed(False):
            assert not flushing() and denormals_made() == _PROBE
        assert flushing() and denormals_made() == 0
    assert not flushing()


def test_the_config_key_off_leaves_the_flags_alone(two_threads: None) -> None:
    with dask.config.set({"dask-train.flush-denormal": False}):
        with flushed() as on:
            assert not on and not flushing() and denormals_made() == _PROBE
        assert call_flushed(report)["denormals"] == _PROBE
    with dask.config.set({"dask-train.flush-denormal": "false"}):  # as an environment sets it
        with flushed() as on:
            assert not on
    with flushed() as on:  # the default: on
        assert on and denormals_made() == 0


def test_call_flushed_sets_the_thread_for_the_call_only() -> None:
    assert call_flushed(flushing) is True
    assert not flushing()  # the calling thread as it was
    with dask.config.set({"dask-train.flush-denormal": False}):
        assert call_flushed(flushing) is False


# -- on a cluster --------------------------------------------------------------------------------
def _make_team(dask_worker: Any = None) -> None:
    """Run on a worker: two intra-op threads from now on (its roles read torch_threads)."""
    from dask_train.runtime._plugin import worker_state

    worker_state(dask_worker).torch_threads = 2
    torch.set_num_threads(2)


def _task_report() -> dict[str, Any]:
    """A plain task: what the worker's other tasks compute with."""
    torch.set_num_threads(2)
    return report()


def _rank_fn(ctx: Any) -> dict[str, Any]:
    """A dt.run loop that reports what its math runs with, before and after a few steps."""
    before = report()
    net = ctx.prepare(torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for x, t in ctx.batches("train", batch_size=64):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x).squeeze(1), t).backward()
        opt.step()
    ctx.report({"loss": 0.0})
    return {"start": before, "end": report()}


def _set_config(value: bool, dask_worker: Any = None) -> None:
    dask.config.set({"dask-train.flush-denormal": value})


def _run(client: Client) -> list[dict[str, Any]]:
    x = np.random.default_rng(0).normal(size=(2_000, 4)).astype(np.float32)
    data = (da.from_array(x, chunks=(500, 4)), da.from_array(x.sum(1), chunks=500))
    result = dt.run(_rank_fn, workers=2, data={"train": data}, client=client)
    return list(result.returns)


def test_dt_run_ranks_flush_while_they_run_and_the_worker_is_as_before_after(denormal_client: Client) -> None:
    denormal_client.run(_make_team)
    # Each worker's task thread gets a team of two, made with the flags off, before the job.
    before = [denormal_client.submit(_task_report, pure=False, workers=[w]).result()
              for w in denormal_client.scheduler_info()["workers"]]
    assert all(not r["thread"] and r["denormals"] == _PROBE for r in before)
    returns = _run(denormal_client)
    assert len(returns) == 2
    for rank in returns:
        for when in ("start", "end"):
            assert rank[when]["thread"], rank
            assert rank[when]["threads"] == 2 and rank[when]["denormals"] == 0, rank
    after = [denormal_client.submit(_task_report, pure=False, workers=[w]).result()
             for w in denormal_client.scheduler_info()["workers"]]
    assert all(not r["thread"] and r["denormals"] == _PROBE for r in after), after


def test_the_config_key_off_on_the_workers_leaves_dt_run_ranks_as_they_are(denormal_client: Client) -> None:
    denormal_client.run(_make_team)
    denormal_client.run(_set_config, False)
    try:
        returns = _run(denormal_client)
    finally:
        denormal_client.run(_set_config, True)
    assert len(returns) == 2
    for rank in returns:
        assert not rank["start"]["thread"] and not rank["end"]["thread"], rank
        assert rank["end"]["denormals"] == _PROBE, rank


class RecordingAdam(torch.optim.Adam):
    """Adam that writes, at each of its first steps, whether its thread flushes denormals (a
    user's own class: the shard stays in its server's process, updated by the push handler)."""

    path = ""

    def step(self, closure: Any = None) -> Any:
        if RecordingAdam.path:
            with open(RecordingAdam.path, "a") as out:
                out.write(json.dumps({"thread": flushing(), "name": threading.current_thread().name})
                          + "\n")
        return super().step(closure)


def _set_path(path: str, dask_worker: Any = None) -> None:
    RecordingAdam.path = path


def _recording_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if RecordingAdam.path:
        with open(RecordingAdam.path + ".trainer", "a") as log:
            log.write(json.dumps({"thread": flushing()}) + "\n")
    return torch.nn.functional.cross_entropy(out, target)


def test_async_ps_trainers_and_servers_step_with_denormals_flushed(denormal_client: Client,
                                                                   tmp_path: Path) -> None:
    path = str(tmp_path / "steps.jsonl")
    denormal_client.run(_set_path, path)
    X, y = dt.datasets.digits(4_000, seed=0, chunks=1_000)
    try:
        dt.Trainer(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 10)),
                   loss=_recording_loss, optimizer=RecordingAdam, lr=1e-3, ps=1, workers=2,
                   batch_size=64, epochs=1, score_every=0.2, progress=False,
                   client=denormal_client).fit(X, y, validation=dt.datasets.digits_test())
    finally:
        denormal_client.run(_set_path, "")
    steps = [json.loads(line) for line in Path(path).read_text().splitlines()]
    trainer = [json.loads(line) for line in Path(path + ".trainer").read_text().splitlines()]
    assert steps and trainer
    assert all(s["thread"] for s in steps), steps[:5]
    assert all(t["thread"] for t in trainer), trainer[:5]
    # The event loop the small shard's update ran on is as it was between pushes.
    assert not any(denormal_client.run(flushing, on_error="return").values())
