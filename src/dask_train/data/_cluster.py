"""What the scheduler says of the cluster now, for the client-side code of every layer above."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distributed import Client


def live_workers(client: Client) -> dict[str, Any]:
    """Every live Dask worker (address -> the scheduler's record of it), asked of the scheduler
    now, from a thread other than the client's event loop.

    Not ``client.scheduler_info(n_workers=-1)["workers"]``: that reads the client's cached
    identity after refreshing it, and the client's own periodic refresh (without workers) can
    overwrite it in between: 3 of 1,000 calls saw no worker at all (measured with the refresh
    every 5 ms), and a search once took a running trial's live worker for lost.
    """
    info = client.sync(client.scheduler.identity, n_workers=-1)
    workers = dict(info.get("workers", {}))
    note_resources(client, workers)
    return workers


#: Attribute of a client: the Dask worker resources each listed worker declares, as last seen.
_DECLARED = "_dask_train_declared_resources"


def note_resources(client: Client, workers: Mapping[str, Any]) -> None:
    """Remember what each worker of a scheduler's listing (address -> its record) declares.

    Every listing the jobs take (:func:`live_workers`, ``runtime._calls.alive_workers``) notes
    it, so that a placement made from that listing, in the client's event loop where nothing
    may wait on the scheduler, reads the resources of the very workers it was given
    (:func:`declared_resources`). A worker declares them when it starts.
    """
    setattr(client, _DECLARED, {a: dict(w.get("resources") or {}) for a, w in workers.items()})


def declared_resources(client: Client) -> dict[str, dict[str, float]]:
    """Worker address -> the resources it declares, from the client's latest listing."""
    return dict(getattr(client, _DECLARED, {}))
