"""One cluster for every TensorFlow test: importing TensorFlow costs each worker process seconds
(tens of seconds on a busy machine), so the tests share the workers that have paid it.

A cluster of its own, not the session's: these tests kill workers and ``close()`` restarts the
workers that held TensorFlow servers, and TensorFlow's memory stays out of the other tests' workers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from distributed import Client, LocalCluster

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
# The thread pools the dask-train plugin gives TensorFlow in a 1-thread worker, here too: results
# compared bit for bit with a worker's must come from kernels that split their sums the same way.
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "2")
pytest.importorskip("tensorflow", reason="the tensorflow extra: pip install dask-train[tensorflow]")
keras = pytest.importorskip(
    "keras", reason="the tensorflow extra (Keras 3): pip install dask-train[tensorflow]")


@pytest.fixture(scope="package")
def tf_client() -> Iterator[Client]:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


@pytest.fixture(autouse=True)
def _keras_seed() -> None:
    keras.utils.set_random_seed(0)
