"""How a role reaches a parameter holder on its worker: a parameter-server shard (async-ps) or a
sync job's rank 0, which publishes its parameters under index 0 of the job.

The ``dask_train_pull`` RPC handler is defined here and registered with the runtime's handler
registry (installed lazily on every worker); the push handler is the parameter server's
(:mod:`dask_train.engines.ps.server`), the direct push transport :mod:`.push_socket`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from distributed import Worker, get_worker
from distributed.protocol import to_serialize

from dask_train.runtime._plugin import worker_state


def pull_params_task(*, job: str, index: int) -> tuple[np.ndarray, int, int, np.ndarray | None]:
    """Dask task: (parameters, version, samples, buffers) of the parameter holder ``index`` here."""
    worker = get_worker()
    state = worker_state(worker).jobs.get(job)
    if state is None:
        raise KeyError(f"job {job!r} is not on worker {worker.address}")
    holder = state.holder(index, address=worker.address, job=job)
    result: tuple[np.ndarray, int, int, np.ndarray | None] = holder.pull()
    return result


def holder_or_reason(worker: Worker, job: str, index: int) -> Any:
    """The holder, or why it is not here. A reply, not an exception: a handler that raises logs
    a traceback on the worker, and a scorer asking before a sync rank 0 has published is normal.
    """
    state = worker_state(worker).jobs.get(job)  # never create the state of an unknown job
    if state is None:
        return f"job {job!r} is not on worker {worker.address}"
    try:
        return state.holder(index, address=worker.address, job=job)
    except KeyError as exc:
        return str(exc.args[0])


def make_pull_handler(worker: Worker) -> Any:
    """The ``dask_train_pull`` handler: the parameters of a shard (or of a sync rank 0)."""

    async def dask_train_pull(job: str, shard: int) -> dict[str, Any]:
        holder = holder_or_reason(worker, job, shard)
        if isinstance(holder, str):
            return {"missing": holder}
        params, version, samples, buffers = await holder.run(holder.pull)
        reply = {"params": to_serialize(params), "version": version, "samples": samples}
        if buffers is not None:
            reply["buffers"] = to_serialize(buffers)
        return reply

    return dask_train_pull
