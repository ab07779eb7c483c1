"""Worker side of the controller's signals to a job's roles: stop, pause and resume, shard saves.

The controller (the chief) decides when to checkpoint. It raises the job's pause id on every
trainer's worker; each trainer pauses at its next consistent point (no gradient half-accumulated,
no push in flight; a sync job's ranks all after the same step), reports where it is in its data
and its RNG state, and waits. With every trainer paused, each parameter server writes its own
shard in parallel, the controller writes the manifest last, and resumes the trainers. A trainer's
own side of a pause is :class:`~dask_train.engines.harness.role.Pauser`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from distributed import get_worker

from dask_train.runtime._plugin import worker_state


def request_pause(job: str, pause_id: int, dask_worker: Any = None) -> None:
    """Run on workers (``client.run``): ask the job's trainers to pause for checkpoint ``pause_id``."""
    state = worker_state(dask_worker).job(job)
    state.pause_id = max(state.pause_id, int(pause_id))


def resume(job: str, pause_id: int, dask_worker: Any = None) -> None:
    """Run on workers (``client.run``): let trainers paused for ``pause_id`` go on."""
    state = worker_state(dask_worker).job(job)
    state.resume(pause_id)


def catch_up(job: str, pause_id: int, resume_id: int, dask_worker: Any = None) -> None:
    """Run on a leaving worker (directly): the pause request still pending (0: none) and the
    latest resume, which it may have missed (see ``RoleEngine._catch_up``). Both only raise
    their ids: a second delivery changes nothing."""
    state = worker_state(dask_worker).job(job)
    if pause_id:
        state.pause_id = max(state.pause_id, int(pause_id))
    state.resume(resume_id)


def shard_positions(job: str, index: int, trainer: int, dask_worker: Any = None) -> list[list[int]]:
    """Run on a server's worker: [epoch, block, rows] applied to shard ``index`` per recent block
    of ``trainer``."""
    state = worker_state(dask_worker).jobs.get(job)
    shard = None if state is None else state.params.get(index)
    seen = getattr(shard, "positions", {}).get(trainer, {})
    return [[e, b, rows] for (e, b), rows in seen.items()]


def shard_version(job: str, index: int, dask_worker: Any = None) -> int:
    """Run on a server's worker: the update count of shard ``index`` (-1 when it is not there)."""
    state = worker_state(dask_worker).jobs.get(job)
    shard = None if state is None else state.params.get(index)
    return int(getattr(shard, "version", -1))


def held_point(job: str, dask_worker: Any = None) -> dict[str, Any] | None:
    """Run on a sync rank's worker: its last applied step and every rank's position at it
    (``{"version", "positions"}``), None when it holds none."""
    state = worker_state(dask_worker).jobs.get(job)
    held = None if state is None or state.dropped else state.held
    return None if held is None else {"version": held.version, "positions": held.positions}


def save_shard_task(*, job: str, index: int, path: str, metadata: Mapping[str, str]) -> dict[str, Any]:
    """Dask task on a server's worker: write shard ``index`` (parameters and optimizer state)."""
    return save_shard_here(job=job, index=index, path=path, metadata=metadata,
                           dask_worker=get_worker())


async def save_shard_direct(*, job: str, index: int, path: str, metadata: Mapping[str, str],
                            dask_worker: Any = None) -> dict[str, Any]:
    """Called directly on a leaving server's worker (out of the scheduler's reach): write shard
    ``index`` in a thread. Dask runs a direct call's plain function on the worker's event loop,
    which the write (a disk, an object store, other workers' memory) would block meanwhile: its
    connections, its heartbeats and the hold of its own hand-over."""
    return await asyncio.to_thread(save_shard_here, job=job, index=index, path=path,
                                   metadata=metadata, dask_worker=dask_worker)


def save_shard_here(*, job: str, index: int, path: str, metadata: Mapping[str, str],
                    dask_worker: Any = None) -> dict[str, Any]:
    """Write shard ``index`` on this worker: inside :func:`save_shard_task`, or called directly
    on a leaving server's worker (out of the scheduler's reach)."""
    state = worker_state(dask_worker).job(job)
    result: dict[str, Any] = state.holder(index, address=dask_worker.address, job=job).save(
        path, metadata=metadata)
    return result


def signal_stop(
    job: str, *, scorer: bool = False, keep_step: int | None = None, dask_worker: Any = None
) -> None:
    """Run on workers (``client.run``): ask the job's trainers, or its scorer, to stop.

    ``keep_step`` tells the scorer which scored snapshot to hand back as the result's model.
    """
    state = worker_state(dask_worker).job(job)
    if scorer:
        state.scorer_keep = keep_step
        state.scorer_stop.set()
    else:
        state.stop.set()


def drop_job(job: str, dask_worker: Any = None) -> None:
    """Run on workers (``client.run``): forget a finished job and free its memory, the
    host-memory segments its roles mapped here included."""
    worker_state(dask_worker).drop(job)
    close_released_segments(collect=True)


def close_released_segments(*, collect: bool = False) -> None:
    """Close the mappings of segments this process's roles let go of whose views are gone
    (``host_memory.release_unmapped``; ``collect``: after a run of the cycle collector). Not
    imported here: only workers that ran a role mapping segments have host_memory loaded."""
    import sys

    host_memory = sys.modules.get("dask_train.engines.holders.host_memory")
    if host_memory is not None:
        host_memory.release_unmapped(collect=collect)
