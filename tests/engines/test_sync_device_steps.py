"""The sync rank's GPU path, run on the CPU: losses checked once the step's sums arrive (a step
with a non-finite loss is done again from the same batches) and the update queued before the
step's counts are read. ``DASK_TRAIN_DEVICE_STEPS=1`` in the workers' environment turns it on
where there is no GPU; ``tests/gpu`` runs it on one. The answers must be the host path's: the
same single-process references as ``test_sync.py``, whose checks these are.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from distributed import Client, LocalCluster
from test_sync import nonfinite_batch_left_out, two_ranks_equal_single_process_training


@pytest.fixture(scope="module")
def device_steps() -> Iterator[Client]:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                      env={"DASK_TRAIN_DEVICE_STEPS": "1"}) as cluster, Client(cluster) as client:
        yield client


def test_a_nonfinite_batch_is_left_out_on_the_device_path(device_steps: Client) -> None:
    result = nonfinite_batch_left_out(device_steps)
    assert all(t["queued_updates"] for t in result.trainers)


def test_two_ranks_with_queued_updates_equal_single_process_training(device_steps: Client) -> None:
    # One rank runs out of data first and steps on with zeros; the step after the last one (no
    # rank has data) is queued, skipped where the parameters are, and not counted.
    result = two_ranks_equal_single_process_training(device_steps)
    assert all(t["queued_updates"] for t in result.trainers)
