"""How the model reaches the cluster for the roles' tasks, and again after its holder died."""

from __future__ import annotations

from typing import Any

from distributed import Client, Future

from dask_train.models._transport import ModulePayload, as_sent

#: Models (and validation pairs) up to this many bytes travel inside a task (see send_module).
EMBED_MODULE_BYTES = 32 << 20


def is_lost(future: Future) -> bool:
    """Whether a scattered ``future``'s data is gone (its only holder died): Dask cannot
    compute it again."""
    return future.status in ("lost", "cancelled", "error")


async def send_module(client: Client, payload: Any, job: str) -> Future:
    """The model on the cluster, for the roles' tasks to take as an argument.

    A model pickled to at most :data:`EMBED_MODULE_BYTES` goes inside a task (one copy in the
    scheduler while the job runs): its result is an ordinary graph key, which Dask recomputes
    when the worker holding it dies, so a restarted or joining role still gets it and nothing
    is logged as lost. A larger model is scattered to one worker (never through the
    scheduler), as are models that are no :class:`~dask_train.models._transport.ModulePayload`.
    """
    size = payload.nbytes if isinstance(payload, ModulePayload) else None
    if size is not None and size <= EMBED_MODULE_BYTES:
        return client.submit(as_sent, payload, pure=False, key=f"dt-module-{job}")
    future: Future = await client.scatter(payload, hash=False, asynchronous=True)
    return future

