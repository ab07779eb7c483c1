"""Per-worker state of dask-train: a worker plugin holding parameter-server shards and feed queues.

Parameters travel over RPC handlers added to the worker (``worker.handlers[...]``), the way Dask's
own P2P shuffle moves data: a handler call costs well under a millisecond plus the copy, while a task
round trip costs 6-11 ms and actors share one thread per worker. Tensors never touch the scheduler.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Protocol

import numpy as np
from distributed import Worker, WorkerPlugin, get_worker
from distributed.protocol import to_serialize

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dask-train"
_STATE_ATTR = "_dask_train_state"


class ShardProtocol(Protocol):
    """What a parameter-server shard offers to the RPC handlers."""

    def apply(
        self, grad: np.ndarray, samples: int, position: Any = None
    ) -> tuple[np.ndarray, int, bool]:
        """Apply a gradient; return (parameters copy, version, stop)."""

    def pull(self) -> tuple[np.ndarray, int, int]:
        """Return (parameters copy, version, samples seen)."""


class JobState:
    """What one training job keeps on one worker."""

    def __init__(self) -> None:
        self.shards: dict[int, ShardProtocol] = {}
        self.feeds: dict[int, queue.Queue[Any]] = {}
        self.stop = threading.Event()
        self.scorer_stop = threading.Event()
        self.scorer_keep: int | None = None
        # Checkpoint pauses: the controller raises pause_id; roles pause at their next consistent
        # point, report where they are, and wait until resume_id reaches the pause they took.
        self.pause_id = 0
        self.resume_id = 0
        self._lock = threading.Lock()

    def wait_resume(self, pause_id: int, *, timeout: float) -> bool:
        """Block until the controller resumes ``pause_id`` (True) or the job is stopped (False).

        Raises ``TimeoutError`` after ``timeout`` seconds: a controller that vanished must not
        leave a role paused forever.
        """
        deadline = time.monotonic() + timeout
        while self.resume_id < pause_id:
            if self.stop.is_set():
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"paused for checkpoint {pause_id} longer than timeout={timeout:g} s; the "
                    "controller did not resume the job"
                )
            self.stop.wait(0.02)
        return True

    def feed(self, trainer: int) -> queue.Queue[Any]:
        """The feed queue of one trainer (created on first use, by the feeder or the trainer)."""
        with self._lock:
            return self.feeds.setdefault(trainer, queue.Queue())


class WorkerState:
    """All dask-train jobs known to one worker process."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.jobs: dict[str, JobState] = {}
        # torch process groups this process joined (group id -> its rank's record, see
        # _torch_rank.py); the record keeps rank 0's TCPStore alive for as long as the group is open.
        self.torch_groups: dict[str, Any] = {}
        self._lock = threading.Lock()

    def job(self, job_id: str) -> JobState:
        """The state of ``job_id`` on this worker, created on first use."""
        with self._lock:
            return self.jobs.setdefault(job_id, JobState())

    def drop(self, job_id: str) -> None:
        """Forget a finished job: its shards, queues and blocks are freed."""
        with self._lock:
            state = self.jobs.pop(job_id, None)
        if state is not None:
            state.stop.set()
            state.scorer_stop.set()


def worker_state(worker: Worker | None = None) -> WorkerState:
    """The dask-train state of this worker process (inside a task or a handler)."""
    worker = worker or get_worker()
    state = getattr(worker, _STATE_ATTR, None)
    if state is None:
        state = WorkerState(worker)
        setattr(worker, _STATE_ATTR, state)
    return state


class DaskTrainPlugin(WorkerPlugin):
    """Installs dask-train's RPC handlers and thread settings on every worker.

    Registering it again (another job, another client) keeps the state of running jobs: the state
    lives on the worker object, not on the plugin instance that a re-registration replaces.

    Parameters
    ----------
    torch_threads : int or None
        Threads for torch's intra-op pool on each worker. ``None`` uses the worker's own thread
        count: nannies set ``OMP_NUM_THREADS=1``, so torch would otherwise run on one thread even on
        a many-core worker, or oversubscribe when set by hand.
    """

    name = PLUGIN_NAME

    def __init__(self, torch_threads: int | None = None) -> None:
        self.torch_threads = torch_threads

    def setup(self, worker: Worker) -> None:
        import torch

        threads = self.torch_threads or max(1, int(worker.state.nthreads))
        torch.set_num_threads(threads)
        worker_state(worker)
        worker.handlers["dask_train_push"] = _make_push(worker)
        worker.handlers["dask_train_pull"] = _make_pull(worker)
        # The data layer's handler, imported here: the plugin is what installs handlers.
        from dask_train.data._feed import make_feed_handler

        worker.handlers["dask_train_feed"] = make_feed_handler(worker)


def _shard(worker: Worker, job: str, shard: int) -> ShardProtocol:
    state = worker_state(worker).jobs.get(job)
    if state is None or shard not in state.shards:
        raise KeyError(
            f"parameter-server shard {shard} of job {job!r} is not on worker {worker.address}; "
            "the worker was restarted or the job has ended"
        )
    return state.shards[shard]


def _make_push(worker: Worker) -> Any:
    async def dask_train_push(
        job: str, shard: int, grad: np.ndarray, samples: int, position: Any = None
    ) -> dict[str, Any]:
        params, version, stop = _shard(worker, job, shard).apply(grad, samples, position)
        return {"params": to_serialize(params), "version": version, "stop": stop}

    return dask_train_push


def _make_pull(worker: Worker) -> Any:
    async def dask_train_pull(job: str, shard: int) -> dict[str, Any]:
        params, version, samples = _shard(worker, job, shard).pull()
        return {"params": to_serialize(params), "version": version, "samples": samples}

    return dask_train_pull
