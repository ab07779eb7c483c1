"""Ctrl-C during a job: its roles stop within about a second, one line says where it can resume.

The controller runs on the client's event loop, and the caller's thread waits in
``Client.sync``. Ctrl-C raises ``KeyboardInterrupt`` in that thread, and distributed's ``sync``
cancels the coroutine it waits for and raises at once, without waiting for it. Left so, the
caller's program went on (or ended, closing the client) while the controller was still stopping
the roles on the workers: the roles could be left running, and their cleanup's messages met a
closed client ("CommClosedError" tracebacks, "cleaning up job ... failed").

So the job runs under a :class:`RunGuard`: the cancellation reaches the job as an
``asyncio.CancelledError`` its cleanup handles (the engine's ``close`` stops the roles and drops
the job's state on its workers), and :func:`interrupted` waits for that cleanup and for the roles'
tasks to end on the workers, at most :data:`CLEANUP_S` seconds (a second Ctrl-C stops waiting),
before it prints one line and hands the caller a ``KeyboardInterrupt`` to raise. That exception is
a plain ``KeyboardInterrupt``, so ``except KeyboardInterrupt`` catches it and an uncaught one ends
a script as Ctrl-C does (exit status 130); its ``checkpoint`` attribute names the checkpoint to
resume from (None when there is none). The line already said everything: an uncaught one prints no
traceback (a ``sys.excepthook`` that passes every other exception on to the hook before it).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from distributed import Client

from dask_train.controller._checkpointing import Checkpoints
from dask_train.controller._state import JobLog
from dask_train.runtime._calls import run_on_live

if TYPE_CHECKING:  # the bar's tqdm is imported where a job makes one, not here
    from dask_train.controller._progress import Progress

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest wait, after Ctrl-C, for the job's roles to stop: the engine's close takes well under a
#: second on a live cluster; a worker that vanished can hold one of its calls for Dask's connect
#: timeout, and the user who pressed Ctrl-C is not kept for that.
CLEANUP_S = 10.0

#: How often a job that has not begun its cleanup is cancelled again (see RunGuard).
_AGAIN_S = 0.1

#: Attribute of the KeyboardInterrupt that :func:`interrupted` returns.
_MARK = "dask_train_interrupted"


class RunGuard:
    """Runs a job's coroutine for ``Client.sync`` and tells other threads when it has ended.

    ``sync`` cancels what it runs when its thread gets ``KeyboardInterrupt``; the guard passes
    that on to the job, and sets :attr:`ended` once the job, cleanup included, is over. Before
    Python 3.12, ``asyncio.wait_for`` can swallow a cancellation that lands as the future it
    waits for completes (the controller waits for its events that way many times a second: a
    job went on training after Ctrl-C), so the job is cancelled again every :data:`_AGAIN_S`
    seconds until ``cleaning()`` says its cleanup has begun, and never after (a cancel would cut
    the cleanup short).

    Parameters
    ----------
    cleaning : callable
        True once the job has taken the cancellation and is cleaning up.
    """

    def __init__(self, cleaning: Callable[[], bool]) -> None:
        self.ended = threading.Event()
        self._cleaning = cleaning
        self._job: asyncio.Future[Any] | None = None
        self._stopping = False  # stop() came before the job started
        self._cancelled = False

    async def run(self, job: Callable[[], Awaitable[T]]) -> T:
        """Run ``job()`` on the running loop; cancelling this stops the job."""
        self._job = asyncio.ensure_future(job())
        self._job.add_done_callback(self._done)
        if self._stopping:
            self.stop()
        try:
            return await asyncio.shield(self._job)  # sync's cancel reaches this await only
        except asyncio.CancelledError:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel the job (on the loop's thread); before it started: as soon as it does."""
        self._stopping = True
        if self._job is not None and not self._cancelled:
            self._cancelled = True
            self._cancel()

    def _cancel(self) -> None:
        job = self._job
        if job is None or job.done() or self._cleaning():
            return
        job.cancel()
        asyncio.get_running_loop().call_later(_AGAIN_S, self._cancel)

    def interrupt(self, loop: Any) -> None:
        """From another thread: stop the job on ``loop`` (distributed's IOLoop)."""
        loop.add_callback(self.stop)

    def _done(self, job: asyncio.Future[Any]) -> None:
        if not job.cancelled():
            job.exception()  # retrieved: its error reached the caller, or was logged already
        self.ended.set()


def interrupted(guard: RunGuard, *, client: Client, job_id: str,
                workers: Callable[[], Iterable[str]], log: JobLog, checkpoints: Checkpoints | None,
                progress: Progress | None = None) -> KeyboardInterrupt:
    """Stop the job ``guard`` runs after Ctrl-C, wait for its roles, print the line; returns the
    ``KeyboardInterrupt`` to raise. A second Ctrl-C while it waits is raised as it comes.

    ``workers()``: the workers of the job's roles, asked once it stopped (the current
    generation's, and its engine's: an async-ps engine adopts workers); ``log``: its records
    (where it stopped) and the checkpoints it wrote; ``checkpoints``: ``checkpoint=``'s store,
    None when the job has none; ``progress``: its progress bar, closed before the line.
    """
    t0 = time.monotonic()
    guard.interrupt(client.loop)
    stopped = guard.ended.wait(CLEANUP_S)
    if stopped:
        # The roles were told to stop; their tasks end a few ms later. Until they have, a
        # program ending now would close the workers under them (embedded cluster: a WARNING
        # per role from each worker), and the next fit would find them busy.
        stopped = client.sync(_roles_ended, client, job_id, set(workers()),
                              deadline=t0 + CLEANUP_S)
    checkpoint, step = _resume_point(checkpoints, written=log.checkpoints)
    line = f"dask-train: interrupted (Ctrl-C){_where(log.records)}"
    if checkpoint is not None:
        line += f"; resume=True continues from checkpoint {checkpoint} (step {step})"
    elif checkpoints is not None:
        line += "; no checkpoint was written yet"
    else:
        line += "; no checkpoint to resume from (checkpoint= keeps one)"
    if not stopped:
        line += f"; its roles were still stopping after {time.monotonic() - t0:.0f} s"
    if progress is not None:
        progress.close("interrupted")  # the bar's last line first, then ours under it
    print(line, file=sys.stderr, flush=True)
    logger.debug("job %s interrupted; stopped in %.2f s", job_id, time.monotonic() - t0)
    error = KeyboardInterrupt(line)
    setattr(error, _MARK, True)
    error.checkpoint = checkpoint  # type: ignore[attr-defined]
    _quiet_uncaught()
    return error


def interrupted_early(error: KeyboardInterrupt) -> KeyboardInterrupt:
    """Ctrl-C before the job's controller started (the data sent or persisted, the roles
    placed): nothing was trained and no role runs yet. Prints the one line, as
    :func:`interrupted` does, and returns the ``KeyboardInterrupt`` to raise; one that
    :func:`interrupted` made already is returned as it is."""
    if getattr(error, _MARK, False):
        return error
    line = "dask-train: interrupted (Ctrl-C) before training started; nothing was trained"
    print(line, file=sys.stderr, flush=True)
    early = KeyboardInterrupt(line)
    setattr(early, _MARK, True)
    early.checkpoint = None  # type: ignore[attr-defined]
    _quiet_uncaught()
    return early


#: A worker's task in these states still runs (or its thread does, once cancelled).
_RUNNING = frozenset({"executing", "long-running", "cancelled", "resumed"})


def job_tasks_running(job_id: str, dask_worker: Any = None) -> int:
    """Run on workers (``client.run``): how many tasks of job ``job_id`` still run here."""
    return sum(1 for key, task in dask_worker.state.tasks.items()
               if job_id in str(key) and task.state in _RUNNING)


async def _roles_ended(client: Client, job_id: str, workers: Iterable[str], *,
                       deadline: float) -> bool:
    """Wait until none of ``workers`` runs a task of job ``job_id``; False at ``deadline``."""
    looked = sorted(workers)
    while True:
        counts = await run_on_live(client, job_tasks_running, job_id, workers=looked)
        if not any(isinstance(n, int) and n for n in counts.values()):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)


def _where(records: Sequence[Mapping[str, Any]]) -> str:
    """`` at step S, epoch E`` from the job's newest history record ("" before the first)."""
    if not records:
        return ""
    last = records[-1]
    epoch = last.get("epoch")
    return f" at step {last.get('step')}" + (f", epoch {epoch:.2f}" if
                                             isinstance(epoch, (int, float)) else "")


def _resume_point(checkpoints: Checkpoints | None, *,
                  written: Sequence[Mapping[str, Any]]) -> tuple[str | None, int | None]:
    """The newest complete checkpoint of ``checkpoints``' path (what ``resume=True`` loads);
    when the store cannot be listed, the newest of those this job ``written``."""
    if checkpoints is None:
        return None, None
    try:
        newest = checkpoints.store.newest()
    except Exception:  # a store that cannot be listed now: what this job wrote
        logger.debug("listing the checkpoints after Ctrl-C failed", exc_info=True)
        return (str(written[-1]["directory"]), int(written[-1]["step"])) if written else \
            (None, None)
    if newest is None:
        return None, None
    directory, manifest = newest
    return str(directory), int(manifest.get("step", -1))


def _quiet_uncaught() -> None:
    """An uncaught interrupt of a job ends the program without a traceback (its line is printed);
    every other exception goes to the hook that was there before."""
    previous = sys.excepthook
    if getattr(previous, _MARK, False):
        return

    def hook(kind: type[BaseException], value: BaseException,
             traceback: TracebackType | None) -> None:
        if getattr(value, _MARK, False):
            return
        previous(kind, value, traceback)

    setattr(hook, _MARK, True)
    sys.excepthook = hook
