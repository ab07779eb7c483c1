"""A generation's role tasks: waiting on them (bounded by the job's timeout, never on a dead
holder), their errors raised as the job's, and the parameter holders' file writes.

:class:`RoleTasks` is the one place a role engine waits on its roles' tasks; the functions below
it watch the holders' workers while it waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from distributed import Client, Future

from dask_train.data._stall import wait_futures
from dask_train.engines.harness import control as worker_side
from dask_train.errors import RoleFailed, TrainingTimeout, WorkerLost
from dask_train.runtime._calls import alive_workers, run_direct

logger = logging.getLogger(__name__)

#: Submits a function to run exactly once on a worker: ``pin(fn, *args, address=, key=, **kw)``.
Pin = Callable[..., Future]


async def raise_if_gone(client: Client, holders: Mapping[str, str], release: list[Future],
                        what: str) -> None:
    """Raise WorkerLost naming the first of ``holders`` (address -> role) that left the
    cluster, after releasing the futures ``release``."""
    alive = await alive_workers(client)
    gone = [(addr, role) for addr, role in holders.items() if addr not in alive]
    if gone:
        for fut in release:
            fut.release()
        addr, role = gone[0]
        raise WorkerLost(f"{what}: {role}'s worker {addr} left the cluster",
                         worker=addr, role=role) from None


async def gather_watching(client: Client, futures: list[Future], *, what: str,
                          holders: Mapping[str, str], release: bool,
                          timeout: float) -> list[Any]:
    """The results of finished role tasks, giving up with WorkerLost when a holder dies.

    A holder that dies after its task finished but before its result came back makes Dask
    run the task again, pinned to the dead worker: a plain gather would wait for ever (seen
    as a hung checkpoint write when a host was killed). ``release``: release the futures then.
    """
    gather = asyncio.ensure_future(client.gather(futures, asynchronous=True))
    deadline = time.monotonic() + timeout
    try:
        while True:
            done, _ = await asyncio.wait({gather}, timeout=1.0)
            if done:
                return list(gather.result())
            await raise_if_gone(client, holders, futures if release else [], what)
            if time.monotonic() >= deadline:
                raise TrainingTimeout(
                    f"{what}: the results did not come back within {timeout:g} s")
    finally:
        # Given up (a holder gone, the deadline, or this wait cancelled: a hand-over's write
        # given up cancels its futures next): a gather left running ends in the futures'
        # FutureCancelledError, which nobody reads and asyncio logs as an ERROR.
        _drop(gather)


class RoleTasks:
    """Waits on one generation's role tasks and has its parameter holders write their files.

    Parameters
    ----------
    client : distributed.Client
    job : str
        The generation's key on the workers.
    timeout : float
        The job's ``timeout``: the longest wait for any of its role tasks.
    pin : callable
        Submits a task pinned to one worker (the engine's ``pinned``).
    leaving : set of str
        The workers that gave notice (shared with the engine): out of the scheduler's reach,
        their holders write by a direct call.
    holders : weakref.WeakMethod
        Of the engine's method that returns the holders a wait watches unless told others
        (address -> role name); weak, so that the engine and this object hold no cycle.
    """

    def __init__(self, client: Client, *, job: str, timeout: float, pin: Pin, leaving: set[str],
                 holders: weakref.WeakMethod[Callable[[], Mapping[str, str]]]) -> None:
        self.client, self.job, self.timeout, self.pin = client, job, timeout, pin
        self.leaving, self._holders = leaving, holders

    def default_holders(self) -> Mapping[str, str]:
        """The engine's default holders (none once the engine is gone)."""
        method = self._holders()
        return method() if method is not None else {}

    async def wait(self, futures: list[Future], *, what: str) -> None:
        """Wait for role tasks, bounded by the timeout; a task's error becomes RoleFailed."""
        try:
            await wait_futures(futures, timeout=self.timeout)
        except TimeoutError:
            raise TrainingTimeout(
                f"{what} took longer than timeout={self.timeout:g} s; check that the workers "
                "are alive (dashboard) or raise timeout="
            ) from None
        for fut in futures:
            if fut.status == "error":
                await raise_role_error(fut, what)

    async def wait_for_holders(self, futures: list[Future], *, what: str,
                               holders: Mapping[str, str] | None = None) -> None:
        """:meth:`wait` for role tasks (starting, saving, stopping), giving up with WorkerLost
        as soon as the worker of one of ``holders`` (address -> role; default: the parameter
        holders, whose tasks are then released) is gone: a task pinned to a worker that left
        would wait until the timeout, and the loss is the controller's to act on."""
        deadline = time.monotonic() + self.timeout
        release = holders is None
        watched = holders or self.default_holders()
        while True:
            try:
                await wait_futures(futures, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    break  # wait below raises TrainingTimeout
                await raise_if_gone(self.client, watched, futures if release else [], what)
        await self.wait(futures, what=what)

    async def gather_from_holders(self, futures: list[Future], *, what: str,
                                  holders: Mapping[str, str] | None = None) -> list[Any]:
        """:meth:`wait_for_holders`, then the results (see :func:`gather_watching`)."""
        await self.wait_for_holders(futures, what=what, holders=holders)
        return await gather_watching(self.client, futures, what=what,
                                     holders=holders or self.default_holders(),
                                     release=holders is None, timeout=self.timeout)

    async def write_holders(self, holders: list[tuple[int, str, dict[str, str]]], *,
                            paths: Callable[[int], str], directory: str) -> dict[int, Any]:
        """Have each ``(index, address, metadata)`` holder write its file, in parallel: by a
        pinned task, or by a direct call on a leaving worker (out of the scheduler's reach; its
        failure fails the hand-over). Index -> the holder's record."""
        direct = [(i, a, m) for i, a, m in holders if a in self.leaving]
        pinned = [(i, a, m) for i, a, m in holders if a not in self.leaving]
        futures = [self.pin(worker_side.save_shard_task, address=a,
                            key=f"dt-save-{time.monotonic_ns()}-{i}", job=self.job, index=i,
                            path=paths(i), metadata=m) for i, a, m in pinned]
        records = await asyncio.gather(*(asyncio.wait_for(run_direct(
            self.client, worker_side.save_shard_direct, job=self.job, index=i, path=paths(i),
            metadata=m, address=a), timeout=self.timeout) for i, a, m in direct))
        written = dict(zip([i for i, _, _ in direct], records))
        if not futures:
            return written
        gather = asyncio.ensure_future(self.gather_from_holders(
            futures, what=f"writing checkpoint {directory}"))
        try:
            while not await _done_within(gather, 0.1):
                if {a for _, a, _ in pinned} & self.leaving:
                    # A holder gave notice while its task waited: a worker closing without
                    # retiring (SIGTERM to `dask worker`) stays in the scheduler's list but
                    # runs no new task, and the write waited for it until the nanny killed
                    # it (a hand-over lost). Write again, that holder by a direct call: the
                    # trainers are still paused, so the files are the same.
                    gather.cancel()
                    await self.client.cancel(futures, asynchronous=True)
                    logger.info("job %s: a holder of checkpoint %s is leaving; its file is "
                                "written by a direct call", self.job, directory)
                    return {**written, **await self.write_holders(pinned, paths=paths,
                                                                  directory=directory)}
            written.update(zip([i for i, _, _ in pinned], gather.result()))
        except asyncio.CancelledError:
            # A write given up (a dt.run report's copy when its generation ends): its tasks
            # go now, while this loop runs, not when the client closes at the program's
            # exit (their done callbacks then meet a closed executor: an ERROR line).
            gather.cancel()
            await self.client.cancel(futures, asynchronous=True)
            raise
        return written


async def raise_role_error(fut: Future, role: str) -> None:
    """Raise :class:`RoleFailed` with the role's own exception and traceback as the cause."""
    exc = await fut.exception()
    tb = await fut.traceback()
    raise RoleFailed(f"{role} failed: {type(exc).__name__}: {exc}") from exc.with_traceback(tb)


def _drop(task: asyncio.Future[Any]) -> None:
    """Cancel ``task``, or read its outcome when it has one: either way asyncio logs no
    "exception was never retrieved" when it is collected."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


async def _done_within(task: asyncio.Future[Any], seconds: float) -> bool:
    """Whether ``task`` is done within ``seconds`` (it is not cancelled when not)."""
    await asyncio.wait({task}, timeout=seconds)
    return task.done()
