"""Shared fixtures: real LocalClusters (processes) for the whole session, of 2 workers and of 4,
and a fixed seed."""

from __future__ import annotations

import logging
import random
import signal
import socket
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import dask
import distributed.client
import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster, default_client

# A LocalCluster closes for good a nanny whose killed worker has not come back within this time
# (distributed's default 15 s): on a loaded CI machine a restart took 18 s, and every later test
# of that cluster ran one worker short. Read when a worker leaves, in this process.
dask.config.set({"distributed.deploy.lost-worker-timeout": "300s"})

# Dask's diagnostics sample at a tenth of their default rates in the suite's clusters: the
# statistical profiler every 100 ms (10 ms), the event loop's tick every 100 ms (20 ms), the
# system monitor every 2 s (0.5 s). An idle LocalCluster of two workers took 9% of a core with
# the defaults, 3% with these (1.8 and 0.6 s of CPU in 20 s), and the session's two clusters
# stay up, idle between their tests, beside every other test. No test reads these figures;
# the profiler still runs (the tests of its pausing see it), only less often.
dask.config.set({"distributed.worker.profile.interval": "100ms",
                 "distributed.admin.tick.interval": "100ms",
                 "distributed.admin.system-monitor.interval": "2s"})



@pytest.fixture(scope="session", autouse=True)
def _fork_the_workers() -> None:
    """The tests' own LocalClusters' workers, restarts included, forked from one server that
    imported distributed, dask-train's plugin and torch once, as the embedded cluster's first
    workers are (``runtime._fork``): a spawned worker imports them itself, 1.4 s of CPU each,
    and this suite starts hundreds (a cluster per module, a restart per kill). Programs the
    tests run as users do (scripts, ``dask worker``) keep their own start; tests whose workers
    must read an environment set after this server started spawn theirs.

    The server also imports ``torch._dynamo`` (``imports=``, as ``dt.connect(imports=...)``
    offers a program): a torch optimizer imports it when it is built, 0.9 s of CPU, and the
    dt.run loops here build one on every worker the suite starts (the departure tests' file
    took 101 CPU s with each worker importing it, 90 with the server's). dask-train's own
    optimizers never import it; ``tests/models/test_optimizers.py`` checks that in a fresh
    process."""
    from dask_train.runtime._fork import fork_workers

    dask.config.set(fork_workers(dask.config.get("distributed.nanny.pre-spawn-environ", {}),
                                 imports=("torch._dynamo",)))

# Plain-torch references in the test process train on one thread, as each worker does: two
# OpenMP threads spinning on a loaded 2-core machine took a 157-step reference from 0.4 s to 29 s.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    # Processes, not threads: the roles start torch and RPC handlers inside real worker processes, as
    # they would on a real cluster. Two workers match the 2-core CI machine.
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster) as client:
        yield client


@pytest.fixture(autouse=True)
def _its_session_client_is_the_default(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test of one of the session's clients (``client``, ``client4``, or a module's own
    ``client``) gets it as Dask's default client, as a program's only client is. Dask's default
    is the client a ``with Client(...)`` entered last (a context variable), else the newest one
    open: with both session clients open in one pytest process, the one made last was every
    later test's default, and a test of the other computed on the wrong cluster (``.compute()``
    ran where neither ``get_task_stream(client)`` nor the workers' counters looked: two
    prediction tests failed after a ``client4`` test). The global default too, for the threads
    a test starts (a context variable does not reach them). Distributed has no public call to
    make an open client the default again."""
    for name in ("client4", "client"):
        if name in request.fixturenames:
            client = request.getfixturevalue(name)
            distributed.client._set_global_client(client)
            with client.as_current():
                yield
            return
    yield


@pytest.fixture(scope="session")
def client4() -> Iterator[Client]:
    """A cluster of four worker processes, for tests of several groups or trials at once
    (tests/runtime/test_torch_group.py, tests/tuning): one for the session, not one per module
    (each cost a start and a close of four processes). Its users may kill its workers: the
    nannies restart them, and each test that needs all four waits for them first."""
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


@pytest.fixture(scope="session")
def s3() -> Iterator[dict[str, Any]]:
    """A local S3 server (moto) on a free port with a bucket, and the s3fs options to reach it
    (one for the session: each test writes under a prefix of its own). The workers have no
    credentials of their own: the options travel with the data's graph and
    with the checkpoint's shard paths."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem(**options).mkdir("train")
    try:
        yield options
    finally:
        server.stop()


@pytest.fixture
def own_client(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Client]:
    """A client of the session cluster made with ``set_as_default=False``, in a process with no
    default client, as in a program that keeps its clients to itself: Dask's default-client
    lookups (``distributed.wait``, ``as_completed`` without ``loop=``) fail during the test. The
    session's own client, if another test made it, is hidden (the global ones and the current
    one ``with Client(...)`` sets) until the test ends."""
    monkeypatch.setattr(distributed.client, "_global_clients", weakref.WeakValueDictionary())
    monkeypatch.setattr(distributed.client, "_current_client",
                        ContextVar("_current_client", default=None))
    with Client(cluster, set_as_default=False) as client:
        with pytest.raises(ValueError, match="No clients found"):
            default_client()
        yield client


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` during the test, as in a terminal or a notebook: a
    process started with SIGINT ignored (a background job of a non-interactive shell, as CI may
    start pytest) would never raise it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
