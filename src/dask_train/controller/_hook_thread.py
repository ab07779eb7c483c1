"""The thread that calls a job's callbacks in order, off the client's event loop. The callbacks
themselves are the user's objects: their base class is a policy
(:class:`~dask_train.policy.callbacks.Callback`), the ready-made ones are in
:mod:`dask_train.callbacks` (TensorBoard, MLflow).

The controller runs on the client's event loop, which also carries every message of the job
(scores, grants, stop signals). A callback run there could neither block (a tracking server, a
file system: scores and stop decisions would wait) nor use the client (``client.run`` from the
loop returns an un-awaited coroutine). So the controller only queues each hook call here; one
thread calls them in the order they were queued, and a hook's request to stop (True) is picked up
by the controller at its next pass (every 0.2 s at most).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from dask_train.controller._state import JobLog
from dask_train.policy.callbacks import Callback, run_callbacks

logger = logging.getLogger(__name__)


class CallbackThread:
    """Calls the hooks of ``callbacks`` in order, on one daemon thread started on first use.

    A daemon thread, not an executor's: a callback that never returns must not keep the
    interpreter from exiting, and the controller stops waiting for it after a timeout.

    Parameters
    ----------
    callbacks : sequence of Callback
    name : str
        The thread's name (the job's id), seen in a stack dump.
    """

    def __init__(self, callbacks: Sequence[Callback], *, name: str = "") -> None:
        self.callbacks = list(callbacks)
        self.name = f"dask-train-callbacks-{name}" if name else "dask-train-callbacks"
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ending: threading.Thread | None = None  # closed, running the hooks left
        self._stop = threading.Event()
        self._error: BaseException | None = None

    def call(self, hook: str, *args: Any) -> None:
        """Queue ``hook(*args)`` for every callback; returns at once."""
        if not self.callbacks:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._queue.put((hook, args))

    def stop_asked(self) -> bool:
        """True once after a hook returned True; a hook's exception is raised here (it ends the
        job as it did when the hooks ran on the loop)."""
        error, self._error = self._error, None
        if error is not None:
            raise error
        if self._stop.is_set():
            self._stop.clear()
            return True
        return False

    async def finish(self, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) for every queued hook, then end the thread; a hook's
        exception is raised. Hooks still running then go on alone (logged)."""
        if self._thread is None:
            return
        done = threading.Event()
        self._queue.put(done)
        finished = await asyncio.get_running_loop().run_in_executor(None, done.wait, timeout)
        self.close()
        if not finished:
            logger.warning("the callbacks were still running %g s after the job ended: it "
                           "returns without them (a hook blocks; see the thread %s)", timeout,
                           self.name)
        self.stop_asked()  # raises a hook's error

    def close(self, wait: float = 0.0) -> None:
        """End the thread once the hooks queued so far have run; wait up to ``wait`` seconds for
        them (a second call only waits: the controller closes on an error, then the caller of
        ``fit`` waits before ``on_fit_error``)."""
        if self._thread is not None:
            self._queue.put(None)
            self._ending, self._thread = self._thread, None
        ending = self._ending
        if wait > 0 and ending is not None and ending is not threading.current_thread():
            ending.join(wait)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            hook, args = item
            try:
                if run_callbacks(self.callbacks, hook, *args):
                    self._stop.set()
            except BaseException as exc:  # the controller raises it at its next pass
                logger.debug("callback %s raised", hook, exc_info=True)
                if self._error is None:
                    self._error = exc


#: Longest wait for the hooks queued before a job's error, before ``on_fit_error``.
_ERROR_WAIT_S = 10.0


def job_failed(callbacks: Sequence[Callback], error: BaseException, *,
               thread: CallbackThread | None = None, log: JobLog | None = None,
               wait: float = _ERROR_WAIT_S) -> None:
    """Tell every callback that the job raised ``error`` (``on_fit_error``), in the caller's
    thread, once the hooks the controller had queued on ``thread`` ran (up to ``wait``
    seconds).

    ``thread`` and ``log``: the job's callback thread and log (what it recorded so far is the
    hook's ``partial``), None when the job failed before its controller was made. A hook's own
    exception is logged: ``error`` is what the caller raises next.
    """
    partial: Mapping[str, Any] = {"records": [], "checkpoints": [], "failures": []}
    if thread is not None:
        thread.close(wait=wait)
    if log is not None:
        partial = {"records": [dict(r) for r in log.records],
                   "checkpoints": [dict(c) for c in log.checkpoints],
                   "failures": [dict(f) for f in log.failures]}
    for callback in callbacks:
        try:
            callback.on_fit_error(error, partial)
        except Exception:  # the job's error is the one to raise
            logger.warning("%s.on_fit_error raised (the job's own error follows)",
                           type(callback).__name__, exc_info=True)
