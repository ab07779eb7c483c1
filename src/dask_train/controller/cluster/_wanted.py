"""Telling an adaptive cluster that a job wants more workers than it has.

A job with ``workers=(least, most)`` starts with the workers there are and takes in each one that
joins, up to ``most``. An adaptive cluster (``cluster.adapt``, dask-jobqueue's, dask-kubernetes',
Dask Gateway's) grows only when its scheduler asks: ``Scheduler.adaptive_target`` counts the tasks
waiting for a worker (``queued`` and ``unrunnable``) beside the occupancy of the running ones, and
caps the count of workers it asks for at the count of tasks. A training job's few long tasks, one
per worker, never wait: the scheduler cannot see that the job would use more workers.

So the job keeps one placeholder task per worker it lacks, ``dt-wants-a-worker-<n>-<job>``: it
asks for a resource no worker has (:data:`RESOURCE`), so it never runs and is never given to a
worker; it waits in the scheduler's ``no-worker`` state, where ``adaptive_target`` counts it. The
scheduler weighs a waiting task by its prefix's known duration, 0.5 s for one never run, against a
target of 5 s of work a worker: two placeholders asked for nothing. So the prefix is declared an
hour's work on the scheduler (:func:`weigh_placeholders`), and ``adaptive_target`` asks for one
more worker per placeholder (it caps the count at the tasks there are). Each is cancelled once
the job has a trainer on a worker that joined for it (not as soon as the worker joins: an idle
worker is what an adaptive cluster retires first), and all of them when the job ends. On a
cluster that is not adaptive they only wait, and cost the scheduler a task each.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed import Client, Future

from dask_train.policy._scope import current_scope

logger = logging.getLogger(__name__)

#: The resource the placeholders ask for: no worker has it, so they wait for a worker forever.
RESOURCE = "dask-train-wants-a-worker"


#: The placeholders' task prefix (``dask.utils.key_split`` of their keys: it stops at the number).
PREFIX = "dt-wants-a-worker"

#: The work a placeholder stands for, as the scheduler weighs it (see the module's text).
WORK_S = 3600.0


def weigh_placeholders(dask_scheduler: Any = None) -> None:
    """Run on the scheduler: count each placeholder as :data:`WORK_S` seconds of work, for the
    prefix made by the next placeholder (the scheduler's ``default-task-durations``) and for the
    one made by an earlier job (a prefix lives as long as the scheduler)."""
    import dask

    durations = dict(dask.config.get("distributed.scheduler.default-task-durations", {}))
    if durations.get(PREFIX) != f"{WORK_S:g}s":
        durations[PREFIX] = f"{WORK_S:g}s"
        dask.config.set({"distributed.scheduler.default-task-durations": durations})
    prefix = dask_scheduler.task_prefixes.get(PREFIX)
    if prefix is not None:
        prefix.duration_average = WORK_S


def _never_runs() -> None:
    """The placeholder's function (it waits for a worker with :data:`RESOURCE`; none comes)."""


def placeholder(client: Client, job: str, n: int) -> Future:
    """Placeholder ``n`` of ``job``: a task that waits for a worker no cluster has (call
    :func:`weigh_placeholders` on the scheduler first)."""
    return client.submit(_never_runs, key=f"{PREFIX}-{n}-{job}", resources={RESOURCE: 1},
                         pure=False)


class WantedWorkers:
    """The placeholder tasks of one job: as many as workers it lacks (see the module's text).

    Parameters
    ----------
    client : distributed.Client
    job : str
        The job's id, in the placeholders' keys.
    most : int or None
        The most workers the job takes (None: every worker, so it never asks for more).
    """

    def __init__(self, client: Client, job: str, most: int | None) -> None:
        self.client, self.job, self.most = client, job, most
        self.waiting: list[Future] = []
        self._made = 0
        self._said = self._weighed = False

    async def update(self, using: int, *, running: bool) -> None:
        """Keep ``most - using`` placeholders while the job ``running`` (none otherwise).

        ``using``: the workers the job has a trainer on. Not the workers alive: one that joined
        is idle until the job takes it in (an async-ps job at once, a sync or ``dt.run`` job at
        its next step or report), and an adaptive cluster retires an idle worker unless the
        tasks waiting still ask for it.
        """
        lacks = 0
        # A job scoped to some workers (a search's trial) would ask for workers it cannot use.
        if running and self.most is not None and current_scope() is None:
            lacks = max(0, self.most - using)
        while len(self.waiting) > lacks:
            await self.client.cancel([self.waiting.pop()], asynchronous=True)
        if len(self.waiting) < lacks and not self._said:
            self._said = True
            logger.info("job %s runs on %d worker(s) and would take %d more: it asks the "
                        "scheduler for them (an adaptive cluster grows for them)",
                        self.job, using, lacks)
        if len(self.waiting) < lacks and not self._weighed:
            self._weighed = True
            await self.client.run_on_scheduler(weigh_placeholders, asynchronous=True)
        while len(self.waiting) < lacks:
            self._made += 1
            self.waiting.append(placeholder(self.client, self.job, self._made))

    def adopt(self, waiting: list[Future]) -> None:
        """Hold placeholders made before the job ran (``dt.run``'s wait for its least, see
        :func:`dask_train.api._run_wait.wait_for_workers`) until its trainers run: cancelled then,
        an adaptive cluster could retire the new workers before the job's tasks reach them."""
        self.waiting.extend(waiting)
        self._weighed = True

    async def close(self) -> None:
        """Cancel every placeholder (the job ended)."""
        await self.update(0, running=False)
