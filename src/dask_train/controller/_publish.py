"""The controller's own events, published on the job's topic for the scheduler's Training page.

The trainers and servers publish their per-second figures themselves (``engines.harness.stats``); what
only the controller knows goes out here, on the topic ``dask-train-<job_id>`` (the generations'
topics are ``dask-train-<job_id>-g<n>``):

* ``{"kind": "start", "wall", "strategy", "roles", "rows", "epochs", ...}`` when a fit starts;
* ``{"kind": "record", <a history row>}``: each score as ``result.history`` will hold it;
* ``{"kind": "failure", "role", "worker", "cause", "action", ...}`` and
  ``{"kind": "generation", "generation", "roles"}`` as the failure policy acts;
* ``{"kind": "nonfinite", ...}`` for each non-finite loss or score;
* ``{"kind": "end", "stopped_by"}`` or ``{"kind": "end", "error"}``.

One message at a time, in order, by a task that ends when the queue is empty: a publish never
blocks the controller, and a job that ends leaves nothing running. A scheduler that cannot take
the events (an old one, a lost connection) costs a debug line, never the job.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from distributed import Client

from dask_train.monitor import ensure_dashboard
from dask_train.policy._placement import Roles
from dask_train.runtime._compat import forget_topics

logger = logging.getLogger(__name__)

# Longest wait for one event to reach the scheduler, and for the last ones at the job's end.
_SEND_TIMEOUT_S = 5.0


def _plain(value: Any) -> Any:
    """``value`` as msgpack-able plain data (numpy scalars become floats, others text)."""
    def default(obj: Any) -> Any:
        return float(obj) if hasattr(obj, "__float__") else str(obj)

    return json.loads(json.dumps(value, default=default))


class JobEvents:
    """Publishes the controller's events on ``dask-train-<job_id>``.

    Parameters
    ----------
    client : distributed.Client
    job_id : str
    """

    def __init__(self, client: Client, job_id: str) -> None:
        self.client, self.topic = client, f"dask-train-{job_id}"
        self.queue: list[dict[str, Any]] = []
        self.sender: asyncio.Task[None] | None = None

    async def start(self, spec: Any, roles: Roles, rows: int) -> None:
        """Make sure the scheduler has the Training page, then announce the job."""
        await ensure_dashboard(self.client)
        self.publish({
            "kind": "start", "wall": time.time(), "job_id": spec.job_id,
            "roles": dict(roles.placement), "rows": rows, **spec.summary(),
            "client": self.client.id,  # a job whose client leaves ended with it
        })

    def publish(self, msg: Mapping[str, Any]) -> None:
        """Queue ``msg`` for the scheduler; returns at once."""
        self.queue.append(_plain(dict(msg)))
        if self.sender is None or self.sender.done():
            self.sender = asyncio.get_running_loop().create_task(self._send())

    async def end(self, **fields: Any) -> None:
        """Publish the job's end and wait (bounded) until every queued event is sent."""
        self.publish({"kind": "end", "wall": time.time(), **fields})
        if self.sender is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.sender), _SEND_TIMEOUT_S)
            except Exception:  # a slow scheduler must not hold the job's result back
                logger.debug("the job's last events did not reach the scheduler in time")

    async def forget(self) -> None:
        """The scheduler forgets the job's event topics (``forget_topics``: its own and its
        generations') once their last events landed."""
        try:
            await self.client.run_on_scheduler(forget_topics, self.topic, asynchronous=True)
        except Exception:  # noqa: BLE001 - a closed client, a scheduler that runs no functions
            logger.debug("%s: the scheduler keeps the job's event topics", self.topic)

    async def _send(self) -> None:
        while self.queue:
            msg = self.queue.pop(0)
            try:
                await asyncio.wait_for(self.client.log_event(self.topic, msg), _SEND_TIMEOUT_S)
            except Exception as exc:  # the page misses one event; the job goes on
                logger.debug("could not publish %s on %s: %s", msg.get("kind"), self.topic, exc)
