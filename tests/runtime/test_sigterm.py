"""SIGTERM to a worker process that serves no job ends it at once, as before dask-train's
handler (``runtime._plugin.close_on_sigterm``); its nanny starts a new one. The handler is set
only in nanny-started worker processes, never in the process of an in-process worker."""

from __future__ import annotations

import os
import signal
import time

from distributed import Client, LocalCluster

from dask_train.runtime._roles import ensure_plugin


def _handler_name() -> str:
    handler = signal.getsignal(signal.SIGTERM)
    return getattr(handler, "__qualname__", str(handler))


def test_a_worker_serving_no_job_ends_on_sigterm_at_once() -> None:
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        ensure_plugin(client)
        [(address, name)] = client.run(_handler_name).items()
        assert name == "close_on_sigterm.<locals>.on_sigterm"
        [nanny] = cluster.workers.values()
        process = nanny.process.process  # the worker's process, as its nanny started it
        [pid] = client.run(os.getpid).values()
        assert process.pid == pid
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        # Ended by the signal (Python's default), not by a close of its own (exit code 0).
        assert process.exitcode == -signal.SIGTERM
        client.wait_for_workers(1, timeout=30)  # its nanny started a new one
        assert list(client.run(_handler_name).values()) == [name]  # set there too


def test_an_in_process_worker_leaves_the_process_handler_alone() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        ensure_plugin(client)
        client.submit(int, 1).result()
        assert signal.getsignal(signal.SIGTERM) is before
