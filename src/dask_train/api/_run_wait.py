"""``dt.run`` waiting for its least workers: placeholder tasks ask an adaptive cluster for them
meanwhile (:mod:`dask_train.controller.cluster._wanted`), and are handed to the job's controller."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from dask_train.controller.cluster._wanted import placeholder, weigh_placeholders
from dask_train.data._cluster import declared_resources
from dask_train.errors import InvalidInput
from dask_train.policy._scope import current_scope
from dask_train.runtime._roles import trainer_workers

if TYPE_CHECKING:
    from distributed import Client

    from dask_train.policy._placement import Placement


def wait_for_workers(client: Client, least: int, *, timeout: float,
                      placement: Placement) -> tuple[dict[str, int], list[Any]]:
    """The live workers, once there are at least ``least`` of them (up to ``timeout``), and the
    placeholder tasks that asked for them, for the job's controller to hold until its ranks run.

    While it waits, the scheduler holds ``least`` placeholder tasks, so that an adaptive cluster
    grows to them (see :mod:`dask_train.controller.cluster._wanted`): not one per worker lacking, as a
    running job holds, since the workers there are have no task yet and the scheduler's target
    counts the tasks only. With resources, the workers counted are those that declare them."""
    deadline = time.monotonic() + timeout
    alive = trainer_workers(client, placement)
    asked: list[Any] = []
    if len(alive) < least and current_scope() is None:
        token = uuid.uuid4().hex[:12]
        client.run_on_scheduler(weigh_placeholders)
        asked = [placeholder(client, token, n) for n in range(least)]
    try:
        while len(alive) < least:
            if time.monotonic() > deadline:
                if placement:
                    raise InvalidInput([placement.too_few(
                        need=least, what=f"workers={least} (after {timeout:g} s)",
                        declared=declared_resources(client))])
                raise InvalidInput([f"workers={least} or more are needed but the cluster has "
                                    f"{len(alive)} Dask workers after {timeout:g} s: add "
                                    "workers, or ask for fewer ranks."])
            time.sleep(0.2)
            alive = trainer_workers(client, placement)
    except BaseException:
        if asked:
            client.cancel(asked)
        raise
    return alive, asked
