"""Per-worker state of dask-train, and the worker plugin that installs its RPC handlers.

Parameters travel over RPC handlers added to the worker (``worker.handlers[...]``), the way Dask's
own P2P shuffle moves data: a handler call costs well under a millisecond plus the copy, while a task
round trip costs 6-11 ms and actors share one thread per worker. Tensors never touch the scheduler.

Engines add their handlers with :func:`register_handler` (a name and the ``"module:factory"`` that
builds it); the plugin installs each as a thin coroutine that imports its module on first call, so
a worker that never serves a parameter server never imports torch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import importlib
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from distributed import Worker, WorkerPlugin, get_worker

from dask_train.runtime._calls import LEAVING_STATES
from dask_train.runtime._compat import fix_keras_serialization, pause_profiler
from dask_train.runtime._quiet_logs import quiet_worker

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dask-train"
_STATE_ATTR = "_dask_train_state"

# Handler name -> "module:factory"; factory(worker) returns the handler coroutine function.
_HANDLERS: dict[str, str] = {
    "dask_train_feed": "dask_train.runtime._enqueue:make_feed_handler",
    "dask_train_files": "dask_train.runtime._worker_files:make_handler",
}


def register_handler(name: str, target: str) -> None:
    """Add an RPC handler that every worker installs when the plugin is (re-)registered.

    Parameters
    ----------
    name : str
        The RPC name (``worker.rpc(address).<name>(...)``).
    target : str
        ``"package.module:factory"``; ``factory(worker)`` returns an ``async def`` handler taking
        keyword arguments. Its module is imported on the worker at the first call.
    """
    _HANDLERS[name] = target


def handler_names() -> list[str]:
    """The RPC handlers the plugin installs, as registered so far in this process."""
    return sorted(_HANDLERS)


class WorkerJob:
    """What one training job keeps on one worker."""

    def __init__(self) -> None:
        # Index -> an object holding a slice of the job's parameters here: a parameter-server
        # shard (async), or a sync rank's own parameters (rank 0's, read by the scorer).
        self.params: dict[int, Any] = {}
        self.feeds: dict[int, queue.Queue[Any]] = {}
        self.stop = threading.Event()
        self.scorer_stop = threading.Event()
        # Dropped (the generation closed under its roles, e.g. after a hand-over): its
        # parameters are freed, and the roles still running end without touching them.
        self.dropped = False
        self.scorer_keep: int | None = None
        # A sync rank's last applied step and every rank's data position at it (its HeldPoint).
        self.held: Any = None
        # Checkpoint pauses: the controller raises pause_id; roles pause at their next consistent
        # point, report where they are, and wait until resume_id reaches the pause they took.
        self.pause_id = 0
        self.resume_id = 0
        self._lock = threading.Lock()
        # Notified on resume: a dt.run rank waits at every report, so the wake-up is its latency.
        self._resumed = threading.Condition()

    def resume(self, pause_id: int) -> None:
        """Let roles paused for ``pause_id`` (or an earlier pause) go on."""
        with self._resumed:
            self.resume_id = max(self.resume_id, int(pause_id))
            self._resumed.notify_all()

    def wait_resume(self, pause_id: int, *, timeout: float) -> bool:
        """Block until the controller resumes ``pause_id`` (True) or the job is stopped (False).

        Raises ``TimeoutError`` after ``timeout`` seconds: a controller that vanished must not
        leave a role paused forever.
        """
        deadline = time.monotonic() + timeout
        with self._resumed:
            while self.resume_id < pause_id:
                if self.stop.is_set():
                    return False
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"paused for checkpoint {pause_id} longer than timeout={timeout:g} s; "
                        "the controller did not resume the job"
                    )
                # A stop is seen within 20 ms; a resume at once (notified).
                self._resumed.wait(0.02)
        return True

    def feed(self, trainer: int) -> queue.Queue[Any]:
        """The feed queue of one trainer (created on first use, by the feeder or the trainer)."""
        with self._lock:
            return self.feeds.setdefault(trainer, queue.Queue())

    def holder(self, index: int, *, address: str, job: str) -> Any:
        """The parameter holder ``index``; KeyError naming the worker when it is not here."""
        holder = self.params.get(index)
        if holder is None:
            raise KeyError(
                f"parameters {index} of job {job!r} are not on worker {address}; the worker was "
                "restarted or the job has ended"
            )
        return holder


class WorkerState:
    """All dask-train jobs known to one worker process."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.jobs: dict[str, WorkerJob] = {}
        # Job -> the model this worker evaluates its validation blocks with (engines.scoring.spread_eval).
        self.evaluators: dict[str, Any] = {}
        # Jobs dropped here (the most recent): a late message for one must not bring it back.
        self.ended: collections.deque[str] = collections.deque(maxlen=1024)
        # torch process groups this process joined (group id -> its rank's record, see
        # _torch_rank.py); the record keeps rank 0's TCPStore alive for as long as the group is open.
        self.torch_groups: dict[str, Any] = {}
        self.torch_threads: int | None = None
        self._torch_configured = False
        self._lock = threading.Lock()
        # Deserialised objects by token, oldest first (dt.predict's models: each is unpickled at
        # most once per worker process, whatever the number of blocks it predicts).
        self.objects: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.objects_lock = threading.Lock()
        self._roles = 0  # training roles running here (see role_running)
        # Set by a job's controller that heard this worker is leaving (hold_for_hand_over).
        self.hand_over_heard = threading.Event()
        # Set by a controller whose hand-over of this worker failed: nothing to wait for.
        self.let_go = threading.Event()
        self._paused_profiler: Any = None

    @contextlib.contextmanager
    def role_running(self) -> Iterator[None]:
        """Mark a training role running in this worker: Dask's statistical profiler is paused
        here while any is, unless ``dask-train.profile-roles`` is true.

        Why: the profiler wakes the worker's event loop every 10 ms to walk the stacks of the
        running tasks, and a role is one task for the whole job. On the digits MLP, with 2 cores
        and two async-ps trainers, those wake-ups preempted the trainers (both cores were busy)
        and cost them 4-8% of their samples per second (paired runs); taking the role's thread
        out of the sampled threads alone gained nothing, the wake-ups being the cost. Tasks that
        run beside a role are not profiled meanwhile; the profiler starts again with the last
        role's end.
        """
        import dask

        keep = bool(dask.config.get("dask-train.profile-roles", False))
        with self._lock:
            self._roles += 1
            if self._roles == 1 and not keep:
                self._paused_profiler = pause_profiler(self.worker)
        try:
            yield
        finally:
            with self._lock:
                self._roles -= 1
                paused = self._paused_profiler if self._roles == 0 else None
                if paused is not None:
                    self._paused_profiler = None
            if paused is not None:
                paused()

    def holding(self) -> bool:
        """Whether a training role runs here or a job's parameters are held here."""
        with self._lock:
            return self._roles > 0 or any(job.params for job in self.jobs.values())

    def job(self, job_id: str) -> WorkerJob:
        """The state of ``job_id`` on this worker, created on first use."""
        with self._lock:
            return self.jobs.setdefault(job_id, WorkerJob())

    def drop(self, job_id: str) -> None:
        """Forget a finished job: its parameters, queues and blocks are freed."""
        with self._lock:
            state = self.jobs.pop(job_id, None)
            self.evaluators.pop(job_id, None)
            self.ended.append(job_id)
        if state is not None:
            state.dropped = True
            state.stop.set()
            state.scorer_stop.set()
            for holder in state.params.values():
                # A large holder owns a thread for its updates (engines' FlatOptimizer.run).
                close = getattr(holder, "close", None)
                if close is not None:
                    close()

    def configure_torch(self) -> None:
        """Set torch's intra-op threads once per process; called by the roles that use torch.

        Nannies set ``OMP_NUM_THREADS=1``, so torch would otherwise run on one thread even on a
        many-core worker. Done here rather than in the plugin's setup, which would import torch
        (2 s) in every worker, also for jobs that never use it.
        """
        if self._torch_configured:
            return
        import torch

        torch.set_num_threads(self.torch_threads or max(1, int(self.worker.state.nthreads)))
        self._torch_configured = True


def _preload(modules: tuple[str, ...]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # only a head start: the role that needs it imports it (and fails) itself
            logger.debug("preloading %s failed", name, exc_info=True)


def configure_tensorflow(threads: int) -> None:
    """Size TensorFlow's thread pools in this process, before it is imported, without importing it.

    Through its environment variables (read when TensorFlow starts its runtime), because the
    first import often happens while a Keras model is unpickled, before any task code could
    call ``tf.config.threading``. Intra-op: the worker's threads, as torch gets
    (:meth:`WorkerState.configure_torch`; nannies set ``OMP_NUM_THREADS=1``). Inter-op: 2, not 1:
    with one, a ParameterServerStrategy step hung here (a remote function's receive waited on
    the only inter-op thread). Values the user set win.
    """
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", str(max(1, threads)))
    os.environ.setdefault("TF_NUM_INTEROP_THREADS", "2")


def worker_state(worker: Worker | None = None) -> WorkerState:
    """The dask-train state of this worker process (inside a task or a handler)."""
    worker = worker or get_worker()
    state = getattr(worker, _STATE_ATTR, None)
    if state is None:
        state = WorkerState(worker)
        setattr(worker, _STATE_ATTR, state)
    return state


def _load(target: str) -> Callable[[Worker], Any]:
    module, _, name = target.partition(":")
    factory: Callable[[Worker], Any] = getattr(importlib.import_module(module), name)
    return factory


def _lazy_handler(worker: Worker, name: str, target: str) -> Any:
    impl: Any = None

    async def handler(**kwargs: Any) -> Any:
        nonlocal impl
        if impl is None:
            impl = _load(target)(worker)
        return await impl(**kwargs)

    handler.__name__ = name
    return handler


#: How long a leaving worker waits for a job's controller to answer its notice before it goes.
ANSWER_S = 5.0


def heard_leaving(dask_worker: Any = None) -> None:
    """Run on a leaving worker (directly): a job's controller heard its notice and hands its
    roles over; the worker stays until they are let go (see :func:`hold_for_hand_over`)."""
    worker_state(dask_worker).hand_over_heard.set()


def let_go(dask_worker: Any = None) -> None:
    """Run on a leaving worker (directly): its job could not hand it over; it need not stay."""
    worker_state(dask_worker).let_go.set()


def _heard(worker: Worker) -> bool:
    """Whether the worker's stream to the scheduler is open: the job hears of a hand-over
    through it. Closed (the whole cluster shuts down), nobody waits for this worker."""
    stream = getattr(worker, "batched_stream", None)
    comm = getattr(stream, "comm", None)
    return comm is not None and not comm.closed()


async def hold_for_hand_over(worker: Worker, state: WorkerState) -> None:
    """Announce a leaving worker to the jobs it serves and wait, bounded, until they let go."""
    if not state.holding():
        if state.jobs:  # a job's blocks queued for a role that has not started here yet
            logger.info("worker %s is leaving: no role of %s runs here and it holds no "
                        "parameters, nothing to hand over", worker.address, sorted(state.jobs))
        return
    import dask

    hold = float(dask.config.get("dask-train.hand-over-hold", 60.0))
    for job in list(state.jobs):
        worker.log_event(f"dask-train-{job}", {"kind": "leaving", "address": worker.address})
    logger.info("worker %s is leaving while it serves %s: held up to %g s for the hand-over",
                worker.address, sorted(state.jobs), hold)
    start = time.monotonic()
    deadline = start + hold
    while state.holding() and time.monotonic() < deadline and _heard(worker) and \
            not state.let_go.is_set():
        if not state.hand_over_heard.is_set() and time.monotonic() - start > ANSWER_S:
            # No job answered (its client gone, or the cluster shutting down under it).
            logger.info("worker %s: no job answered its leaving notice within %g s",
                        worker.address, ANSWER_S)
            return
        await asyncio.sleep(0.05)
    if state.let_go.is_set():
        logger.info("worker %s: its job gave up the hand-over; it goes", worker.address)
    elif state.holding() and _heard(worker):
        logger.warning("worker %s leaves with its jobs %s not handed over after %g s "
                       "(dask-train.hand-over-hold): they recover as from a lost worker",
                       worker.address, sorted(state.jobs), hold)
    elif state.holding():
        # Was said "hand-over done" too, and read so in a failed hand-over's log.
        logger.info("worker %s: its connection to the scheduler closed while it still held "
                    "%s: it goes (a hand-over not finished by then is handled as a loss)",
                    worker.address, sorted(state.jobs))
    else:
        logger.info("worker %s: hand-over done", worker.address)


def close_on_sigterm(worker: Worker) -> bool:
    """In a worker process that a nanny started, make SIGTERM close the worker (its roles
    handed over first, see :meth:`DaskTrainPlugin.teardown`) while it serves a job, instead of
    ending the process at once. Returns whether the handler was installed.

    Why: a batch system signals every process of a job. At a Slurm job's walltime (and on
    ``scancel``) the worker process got SIGTERM beside its nanny and died on it within
    milliseconds (Python's default), so the nanny's orderly close came too late and the
    job's roles were lost, not handed over. Now the worker closes as the nanny asks it to
    on SIGTERM; a worker serving no job still ends at once, as before, and a second SIGTERM
    ends it at once. Without a nanny (``dask worker --no-nanny``), ``dask worker``'s own
    SIGTERM handling applies; outside a process's main thread (an in-process worker) or where
    a handler is already set, nothing changes.
    """
    if getattr(worker, "nanny", None) is None or \
            threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # set up outside the worker's loop: no way to reach it from a handler
        return False

    def end_now() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the default handler is back

    async def close() -> None:
        if not worker_state(worker).holding():
            end_now()
            return
        logger.info("worker %s got SIGTERM while it serves %s: it closes, its roles handed "
                    "over first", worker.address, sorted(worker_state(worker).jobs))
        # nanny=False: a nanny that was not signalled starts a new worker, as it would have
        # after the process died.
        await worker.close(nanny=False, reason="signal-15")

    def on_sigterm(signum: int, frame: Any) -> None:
        # Nothing that takes a lock here (the main thread may hold it): the loop decides.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(close()))
        except RuntimeError:  # the loop closed already: the process is on its way out
            end_now()

    signal.signal(signal.SIGTERM, on_sigterm)
    return True


class DaskTrainPlugin(WorkerPlugin):
    """Installs dask-train's RPC handlers and thread settings on every worker.

    Registering it again (another job, another client) keeps the state of running jobs: the state
    lives on the worker object, not on the plugin instance that a re-registration replaces.

    Parameters
    ----------
    torch_threads : int or None
        Threads for torch's intra-op pool on each worker, set when a role first uses torch.
        ``None`` uses the worker's own thread count.
    handlers : mapping of str to str, optional
        RPC name -> ``"module:factory"``; by default every handler registered in this process.
    preload : sequence of str
        Modules each worker imports in a background thread as soon as the plugin is set up
        (``connect`` preloads torch when the client's program uses it): the import, 2 s here,
        overlaps the client's own preparation instead of delaying the first role.
    """

    name = PLUGIN_NAME

    def __init__(self, torch_threads: int | None = None,
                 handlers: Mapping[str, str] | None = None, preload: tuple[str, ...] = ()) -> None:
        self.torch_threads = torch_threads
        self.handlers = dict(_HANDLERS if handlers is None else handlers)
        self.preload = tuple(preload)

    async def teardown(self, worker: Worker) -> None:
        """On the worker's way out: hold it for its jobs' hand-over, then skip the
        interpreter's last garbage collection.

        A worker that leaves with notice (``retire_workers``, ``dask worker --lifetime``, a
        scale-down, an adaptive cluster) is closed by the scheduler after it was removed from
        the scheduler's list; its roles' threads still run and its server still answers. While
        it holds a training role or a job's parameters, it tells each job ("leaving" on the
        job's event topic) and waits, at most ``dask-train.hand-over-hold`` seconds (60), until
        the controller has taken its state and dropped the job here (see
        :mod:`dask_train.controller.cluster._departures`); without an answer from a controller within
        :data:`ANSWER_S` seconds (the cluster shuts down under a job), it goes at once.

        A worker process that imported torch spent 2-3 s (and more under load) in the final
        ``gc`` pass of its interpreter shutdown, past the 4 s the nanny waits before killing it
        ("Worker process still alive after 4.0 seconds, killing" on every close). Freezing the
        objects alive now moves them out of the collector's reach; the process ends right after.
        Only when the worker is closing: a plugin is also torn down when it is registered again.
        """
        if worker.status.name not in LEAVING_STATES:
            return
        await hold_for_hand_over(worker, worker_state(worker))
        gc.freeze()

    def setup(self, worker: Worker) -> None:
        if self.preload:
            threading.Thread(target=_preload, args=(self.preload,), daemon=True,
                             name="dask-train-preload").start()
        quiet_worker(worker)
        close_on_sigterm(worker)
        state = worker_state(worker)
        state.torch_threads = self.torch_threads or state.torch_threads
        configure_tensorflow(int(state.torch_threads or worker.state.nthreads))
        fix_keras_serialization()  # Keras 3 models arrive pickled (see runtime._compat)
        for name, target in self.handlers.items():
            worker.handlers[name] = _lazy_handler(worker, name, target)
