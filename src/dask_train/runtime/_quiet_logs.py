"""Filters of distributed's log for what dask-train's own handling makes no error: a heartbeat
cut by its worker closing, a role's task cancelled by its worker's departure, a rank that failed
because a peer died, a batched stream's close, scattered blocks dask-train sends again, a closed
worker's stop queue read as its process ends, a transfer cut as its worker retired, a role's
result gathered from a worker that left (the scheduler's ERROR, the client's orphaned waits), a
job's role that raised one of dask-train's own errors. Each leaves every other record as
distributed logs it. Installed on the workers by the plugin (:func:`quiet_worker`), on the
scheduler by ``dt.connect`` or a job's first use of a client (:func:`quiet_scheduler`), in the
client's process (:func:`quiet_client`), and for one job's time by its controller
(:func:`quiet_job`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from distributed import Worker, WorkerPlugin

from dask_train.runtime._calls import LEAVING_STATES

_HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat"

#: The workers of this process that have dask-train's plugin (one under a nanny; several in an
#: in-process cluster): the filters below ask whether they are closing or closed.
_workers: weakref.WeakSet[Worker] = weakref.WeakSet()


class _ClosingHeartbeat(logging.Filter):
    """Leaves out distributed's heartbeat error of a worker that is closing.

    A heartbeat in flight when its worker closes fails as the worker closes its own connections,
    and distributed logs it as an ERROR with a traceback, though nothing went wrong: seen at the
    end of a script on the embedded cluster under load. A heartbeat that fails while its worker
    runs is still logged. The workers of one process are one set: an in-process cluster's
    closing worker quiets the others' heartbeat errors while it closes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not str(record.msg).startswith(_HEARTBEAT_FAILED):
            return True
        return not any(w.status.name in LEAVING_STATES for w in list(_workers))


_closing_heartbeat = _ClosingHeartbeat()


class _RoleCancelled(logging.Filter):
    """Leaves out distributed's WARNING that a role's task "ended with CancelledError" as its
    worker closes.

    A worker that leaves with notice cancels the coroutines awaiting its running tasks before
    its plugins' teardown; a role runs as one task for the whole job, so every departure of a
    role's worker logged it, though the role goes on until its hand-over ends (see
    :func:`dask_train.runtime._plugin.hold_for_hand_over`). Other tasks' cancellations are still logged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage() if record.levelno == logging.WARNING else ""
        return not (text.startswith("Async instruction for") and "execute('dt-" in text
                    and text.endswith("ended with CancelledError"))


_role_cancelled = _RoleCancelled()

#: What a rank's collective raises when a peer's process died (host_sum.HostSum.check, gloo).
_PEER_GONE = ("Connection reset: rank", "Connection closed by peer", "its server's process")


class _PeerLost(logging.Filter):
    """Leaves out distributed's ERROR "Compute Failed" (with a traceback) of a role's task that
    ended because a peer's process died: the peer's loss is the job's to report, and it does
    (``result.failures``, a WARNING line); the survivors' own error would read as a second,
    unexplained failure. A role's own error is still logged, as are other tasks'."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.ERROR:
            return True
        text = record.getMessage()
        return not (text.startswith("Compute Failed") and "Key:       dt-" in text
                    and any(cause in text for cause in _PEER_GONE))


_peer_lost = _PeerLost()


class _ClosedStopQueue(logging.Filter):
    """Logs distributed's "Worker process died unexpectedly" at INFO, without its traceback,
    when the worker of this process had closed already.

    A nanny's worker process watches a queue for its nanny's stop message on a thread. When the
    worker closes by itself (``dask worker --lifetime``, a retirement), the process closes that
    queue on its way out while the thread still reads it, and the read fails (``TypeError``:
    the queue's handle is gone). distributed then logs an ERROR with a traceback after "Worker
    closed", though nothing died: seen on 3 of 6 ``dask worker --lifetime`` exits with
    dask-train's plugin on them, and 0 of 6 without (why the plugin changes the race is not
    known; the nanny closes about 2 s after "Worker closed" either way). A worker that dies
    while it runs is still logged as distributed logs it.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        workers = list(_workers)
        if record.levelno >= logging.ERROR and record.msg == "Worker process died unexpectedly" \
                and record.exc_info and isinstance(record.exc_info[1], (TypeError, OSError)) \
                and workers and all(w.status.name == "closed" for w in workers):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = ("the worker's stop queue was closed as its process ended (the worker "
                          "had closed; nothing died)")
            record.exc_info, record.exc_text = None, None
        return True


_closed_stop_queue = _ClosedStopQueue()


#: Workers the scheduler told this process it removed (address -> when): a fetch from one cut
#: after that was cut by distributed itself, which closes its connections to a removed worker.
_removed: dict[str, float] = {}
_REMOVED_KEPT_S = 60.0


class _RetiredTransfer(logging.Filter):
    """Logs distributed's ERRORs of a data transfer cut because its sender retired at INFO,
    without their tracebacks.

    A worker that retires (``retire_workers``, ``--lifetime``, a scale-down) is removed by the
    scheduler once its unique data is copied elsewhere, without waiting for peers still fetching
    from it; each other worker then closes its connections to it, and a fetch in flight fails:
    "Worker stream died during communication" on the peer and "failed during get data" on the
    retiring worker, each an ERROR with a traceback, though the peer fetches the data again from
    another worker (seen on 1 of 16 ``dask worker --lifetime`` departures under load). A fetch
    from a worker that dies before the scheduler removes it is still logged as distributed logs
    it, and so is any other transfer's failure.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.args:
            return True
        args: Any = record.args
        if record.msg == "Worker stream died during communication: %s" and args[0] in _removed:
            why = "it was removed from the cluster as it left; its data is fetched from another"
        elif record.msg == "failed during get data with %s -> %s" and any(
                w.status.name in LEAVING_STATES and w.address == args[0] for w in list(_workers)):
            why = "this worker is leaving the cluster; the peer fetches the data from another"
        else:
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg, record.args = f"{record.getMessage()} ({why})", None
        record.exc_info, record.exc_text = None, None
        return True


_retired_transfer = _RetiredTransfer()


def _note_removals(worker: Worker) -> None:
    """Remember each worker the scheduler says it removed (its "remove-worker" message, which
    makes this worker close its connections to it), for :class:`_RetiredTransfer`."""
    handle = worker.stream_handlers.get("remove-worker")
    if handle is None or getattr(handle, "_dask_train_noted", False):
        return

    def noted(**msg: Any) -> Any:
        now = time.monotonic()
        for address, when in list(_removed.items()):
            if now - when > _REMOVED_KEPT_S:
                _removed.pop(address, None)
        _removed[str(msg.get("worker"))] = now
        return handle(**msg)

    noted._dask_train_noted = True  # type: ignore[attr-defined]
    worker.stream_handlers["remove-worker"] = noted


def quiet_worker(worker: Worker) -> None:
    """Install this module's filters of a worker's log (by the dask-train plugin)."""
    nanny = logging.getLogger("distributed.nanny")
    if _closed_stop_queue not in nanny.filters:
        nanny.addFilter(_closed_stop_queue)
    log = logging.getLogger("distributed.worker")
    if _closing_heartbeat not in log.filters:
        log.addFilter(_closing_heartbeat)
    if _peer_lost not in log.filters:
        log.addFilter(_peer_lost)
    if _retired_transfer not in log.filters:
        log.addFilter(_retired_transfer)
    _note_removals(worker)
    _workers.add(worker)
    machine = logging.getLogger("distributed.worker.state_machine")
    if _role_cancelled not in machine.filters:
        machine.addFilter(_role_cancelled)
    quiet_batched_close()


class _BatchedClosed(logging.Filter):
    """Keeps distributed's INFO line "Batched Comm Closed" but drops its traceback.

    When a cluster closes, a batched stream whose other end closed first (a worker retired
    while the scheduler still sends to it) logs that line with the ``CommClosedError``'s whole
    traceback, at INFO: seen at the end of a script on the embedded cluster whose logging was
    at INFO. A client's own stream does it too as the client closes (dask/distributed#7192): a
    message queued after its "close-stream" is written once the scheduler has closed its end,
    seen at the end of a script on a ``dask scheduler`` after Ctrl-C, under load. Nothing went
    wrong, and a normal run's log should show no traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Batched Comm Closed") and record.exc_info \
                and type(record.exc_info[1]).__name__ == "CommClosedError":
            record.exc_info, record.exc_text = None, None
        return True


_batched_closed = _BatchedClosed()


class _ResentData(logging.Filter):
    """Logs the scheduler's "lose scattered data, which can't be recovered" at INFO when every
    lost key is in-memory data dask-train sends again (:mod:`dask_train.data._scatter`): a
    killed worker's blocks are not lost to the job, and an ERROR line would say they were."""

    _KEY = re.compile(r"'([^']*)'")

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.msg
        if record.levelno >= logging.ERROR and isinstance(text, str) \
                and "caused the cluster to lose scattered data" in text:
            from dask_train.data._scatter import RESENT_PREFIX

            lost = text.partition("can't be recovered: ")[2].rpartition(" (stimulus_id")[0]
            keys = self._KEY.findall(lost)
            if keys and all(k.startswith(RESENT_PREFIX) for k in keys):
                record.levelno, record.levelname = logging.INFO, "INFO"
                record.msg = text.replace("which can't be recovered",
                                          "which dask-train sends again from its client")
        return True


_resent_data = _ResentData()


def quiet_scheduler() -> None:
    """Install this module's filters of the scheduler's log in this process (the embedded
    cluster's, or, through ``run_on_scheduler``, a remote one's)."""
    quiet_batched_close()
    log = logging.getLogger("distributed.scheduler")
    for quiet in (_resent_data, _lost_role_result):
        if quiet not in log.filters:
            log.addFilter(quiet)


def quiet_batched_close() -> None:
    """Install :class:`_BatchedClosed` in this process (the scheduler's, a worker's, or the
    client's)."""
    log = logging.getLogger("distributed.batched")
    if _batched_closed not in log.filters:
        log.addFilter(_batched_closed)


class _OrphanedGatherWait(logging.Filter):
    """Leaves out asyncio's "Task exception was never retrieved" for distributed's ``AllExit``.

    ``Client.gather`` waits on each future in a task of its own (``distributed.utils.All``);
    cancelled from outside, it leaves those tasks unwatched, and each raises ``AllExit`` (its
    control-flow signal, "stop waiting") once its future is released. dask-train cancels a
    gather whose role's worker left (:func:`dask_train.engines.roles.waiting.gather_watching`),
    and a traceback ended the log of every fit that survived a lost worker. Any other
    unretrieved exception is still logged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (type(exc).__name__ == "AllExit"
                    and str(record.msg).startswith("Task exception was never retrieved"))


_orphaned_gather_wait = _OrphanedGatherWait()


class _OrphanedBatchedWait(logging.Filter):
    """Leaves out asyncio's "Future exception was never retrieved" for tornado's own timeout,
    ``TimeoutError('Timeout')``: the exception ``tornado.gen.with_timeout`` sets on the future it
    returns when its time is up. In a client's process the one such wait is distributed's
    ``BatchedSend``, which waits on ``tornado.locks.Event.wait(deadline)`` in an old-style
    ``gen.coroutine``; a stream closed under it (a worker's SIGTERM) can drop that coroutine
    mid-wait (distributed's batched.py says as much), and the timeout then fires with no one left
    to read it: one ERROR line at the end of a fit that handed its roles over, seen on a
    loaded machine. Any other unretrieved exception is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, TimeoutError) and str(exc) == "Timeout"
                    and str(record.msg).startswith("Future exception was never retrieved"))


_orphaned_batched_wait = _OrphanedBatchedWait()


def quiet_client() -> None:
    """Install this module's filters of the client's own log in this process."""
    quiet_batched_close()
    log = logging.getLogger("asyncio")
    for quiet in (_orphaned_gather_wait, _orphaned_batched_wait):
        if quiet not in log.filters:
            log.addFilter(quiet)


class _LostRoleResult(logging.Filter):
    """Logs the scheduler's "Couldn't gather keys" at INFO when every key is a dask-train role's
    (``dt-``) result whose worker left: the job meets that loss itself (it restarts or hands
    the role over, and says so), and an ERROR line would read as a second, unexplained failure.
    Any other key keeps the ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        # logging keeps a lone mapping argument as ``args`` itself, not in a tuple.
        keys = record.args
        if record.levelno >= logging.ERROR and record.msg == "Couldn't gather keys: %s" \
                and isinstance(keys, dict) and keys \
                and all(str(k).startswith("dt-") for k in keys):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = "a dask-train role's result was on a worker that left: %s"
        return True


_lost_role_result = _LostRoleResult()
class _JobsOwnErrors(logging.Filter):
    """Leaves out distributed's ERROR "Compute Failed" (with a traceback) of one job's task
    that raised one of dask-train's own errors (:class:`~dask_train.DaskTrainError` and its
    subclasses: an ``InvalidInput`` of ``ctx.dataset``, a ``BlockReadError``...).

    The job's controller raises that error to its caller with its one clear message, as
    ``RoleFailed: rank 0 on ... failed: InvalidInput: ...`` (the rank's traceback chained);
    distributed's record, one per rank, printed before it, buried that message under tracebacks
    of dask-train's own frames. Another job's records, a task's other errors (a user's own
    ``ZeroDivisionError`` keeps its record) and every other record are left as they are.

    Parameters
    ----------
    job : str
        The job's id: its tasks' keys end with ``-{job}-g{generation}``.
    """

    def __init__(self, job: str) -> None:
        super().__init__()
        self.job = job

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.ERROR or not str(record.msg).startswith("Compute Failed"):
            return True
        return not (_own_task(record.args, self.job) and _own_error(record.args))


def _own_task(args: Any, job: str) -> bool:
    """Whether a "Compute Failed" record's key (its first argument) is a task of ``job``."""
    key = str(args[0]) if isinstance(args, tuple) and args else ""
    return key.startswith("dt-") and re.search(rf"-{re.escape(job)}-g\d+$", key) is not None


def _own_error(args: Any) -> bool:
    """Whether a "Compute Failed" record's exception (its fourth argument, the exception's
    ``repr`` as distributed's worker formats it) is one of dask-train's own errors."""
    from dask_train.errors import DaskTrainError

    text = str(args[3]) if isinstance(args, tuple) and len(args) > 3 else ""
    name = text.partition("(")[0]
    own, stack = set(), [DaskTrainError]
    while stack:  # every subclass, those defined outside dask_train.errors too
        cls = stack.pop()
        own.add(cls.__name__)
        stack.extend(cls.__subclasses__())
    return name in own


class QuietJob(WorkerPlugin):
    """A worker plugin installing :class:`_JobsOwnErrors` for one job in each worker's log
    while the job runs (a worker that joins or restarts during the job gets it too: the
    scheduler keeps the plugin until :func:`quiet_job` unregisters it, and its teardown
    removes the filter again).

    Parameters
    ----------
    job : str
        The job's id.
    """

    def __init__(self, job: str) -> None:
        self.job = job
        self._filter: _JobsOwnErrors | None = None

    def setup(self, worker: Worker) -> None:
        self._filter = _JobsOwnErrors(self.job)
        logging.getLogger("distributed.worker").addFilter(self._filter)

    def teardown(self, worker: Worker) -> None:
        if self._filter is not None:
            logging.getLogger("distributed.worker").removeFilter(self._filter)
            self._filter = None


#: How long registering or unregistering a job's plugin may take: a scheduler whose worker
#: just died may wait for it; the job goes on (with Dask's records) rather than wait longer.
_PLUGIN_TIMEOUT_S = 10.0


@asynccontextmanager
async def quiet_job(client: Any, job: str) -> AsyncIterator[None]:
    """Quiet distributed's "Compute Failed" records of ``job``'s tasks that raised dask-train's
    own errors (:class:`QuietJob`) on every worker while the block runs, and only then: the
    filter is removed again however the block ends, the user's own logging left as it was.

    Parameters
    ----------
    client : distributed.Client
        An asynchronous use of the job's client (on its event loop).
    job : str
        The job's id.
    """
    from distributed.protocol.pickle import dumps

    name = f"dt-quiet-{job}"
    try:
        await asyncio.wait_for(client.scheduler.register_worker_plugin(
            plugin=dumps(QuietJob(job)), name=name, idempotent=False), _PLUGIN_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - quieter logs are no reason to fail the job
        logging.getLogger(__name__).debug("job %s: its log filter was not installed: %r", job, exc)
    try:
        yield
    finally:
        try:
            await asyncio.wait_for(client.scheduler.unregister_worker_plugin(name=name),
                                   _PLUGIN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a closed client: the workers went with it
            logging.getLogger(__name__).debug("job %s: its log filter was not removed: %r",
                                              job, exc)
