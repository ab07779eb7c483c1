"""``strategy="auto"``'s measurement on one machine (``engines.measure.step``): each
candidate's whole step run on real workers, every process at once."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt
from dask_train.data._cluster import live_workers
from dask_train.engines.holders import host_memory
from dask_train.engines.measure.step import candidate_rate_task, segment_path
from dask_train.policy._settings import OptimizerSettings
from dask_train.runtime._roles import ensure_plugin


def _probe_segments(client: Client) -> list[str]:
    """The probes' segments the cluster's workers made (another program on the machine, a
    second test run among them, makes and removes its own meanwhile)."""
    workers = set(client.run(os.getpid).values())
    return sorted(n for n in os.listdir(host_memory.SEGMENT_DIR)
                  if n.startswith(f"{host_memory.PREFIX}probe-")
                  and host_memory.owner(os.path.join(host_memory.SEGMENT_DIR, n)) in workers)


def _run(client: Client, mode: str, world: int, *, module: torch.nn.Module | None = None,
         duration_s: float = 0.05) -> list[float]:
    X, y = dt.datasets.digits(256, seed=0)
    x, t = np.asarray(X[:64].compute()), np.asarray(y[:64].compute())
    torch.manual_seed(0)
    net = module or torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                        torch.nn.Linear(32, 10))
    ensure_plugin(client)
    workers = sorted(live_workers(client))
    path, start = segment_path(), time.time() + 0.3
    futures = [client.submit(candidate_rate_task, net, x, t, mode=mode, loss="cross_entropy",
                             optim=OptimizerSettings("adam", 1e-3), rank=r, world=world,
                             path=path, start_at=start, duration_s=duration_s, timeout=20,
                             workers=[workers[r]], pure=False) for r in range(world)]
    return [float(f.result(60)) for f in futures]


@pytest.mark.parametrize("mode,world", [("one", 1), ("async", 2), ("sync", 2)])
def test_each_candidate_steps_on_real_workers_and_leaves_no_segment(client: Client, mode: str,
                                                                     world: int) -> None:
    before = _probe_segments(client)
    # Sync ranks run the same rounds, each timed from its own start: a rank whose task started
    # late (a loaded machine) adds its delay to the other's time, and 0.5 s keeps that small.
    rates = _run(client, mode, world, duration_s=0.5 if mode == "sync" else 0.05)
    assert len(rates) == world and all(r > 0 and np.isfinite(r) for r in rates), rates
    # A step of a 2.4k-parameter MLP on 64 rows takes about a millisecond here, and 11 ms with
    # two sync ranks on a 2-core machine running another test suite beside (87 steps/s): a rate
    # under 20 would mean the step was not what ran.
    assert min(rates) > 20, rates
    if mode == "sync":
        # Lockstep: both ranks ran the same rounds over nearly the same time.
        assert max(rates) / min(rates) < 1.5, rates
    assert _probe_segments(client) == before


def test_a_rank_that_fails_releases_its_peers_at_once(client: Client) -> None:
    # Rank 1's module cannot take the batch (wrong input width): it raises, and rank 0, waiting
    # for it in the sum, is released with an error well before its 20 s timeout.
    before = _probe_segments(client)
    started = time.perf_counter()
    with pytest.raises((ConnectionAbortedError, RuntimeError)):
        _run(client, "sync", 2, module=torch.nn.Linear(3, 10))
    assert time.perf_counter() - started < 15
    assert _probe_segments(client) == before
