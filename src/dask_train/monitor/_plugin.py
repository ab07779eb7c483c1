"""The scheduler plugin behind the Training page and the ``dask_train_*`` Prometheus metrics.

Registered by every fit (:func:`ensure_dashboard`, idempotent), so it works on any cluster whose
scheduler can import dask-train: it runs inside the scheduler, receives every event the job
publishes through ``SchedulerPlugin.log_event`` (no subscription, no client in the loop), and
serves what it built from them at ``/training`` and ``/metrics`` on the scheduler's own HTTP
server. So the page works for a remote cluster, and it still shows the last job after it ended.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any

import dask.config
from distributed import Client
from distributed.diagnostics.plugin import SchedulerPlugin

from dask_train.monitor._jobs import PREFIX, Jobs
from dask_train.monitor._live import PLUGINS

logger = logging.getLogger(__name__)

#: The plugin's name on the scheduler (``scheduler.plugins[NAME]``).
NAME = "dask-train-dashboard"


class TrainingDashboard(SchedulerPlugin):
    """Collects dask-train jobs' events on the scheduler; serves the page and the metrics.

    Parameters
    ----------
    keep : int
        Jobs remembered (the page lets you pick one; metrics cover them all).

    Examples
    --------
    >>> import dask_train as dt
    >>> client = dt.connect()                                      # doctest: +SKIP
    >>> client.register_plugin(dt.monitor.TrainingDashboard())     # doctest: +SKIP
    >>> client.dashboard_link.replace("status", "training")        # doctest: +SKIP
    'http://127.0.0.1:8787/training'
    """

    idempotent = True  # a second fit keeps the first plugin and its jobs
    name = NAME

    def __init__(self, keep: int = 10) -> None:
        self.jobs = Jobs(keep=keep)
        self.scheduler: Any = None
        self.page: Any = None  # the Bokeh application serving /training, when there is one

    async def start(self, scheduler: Any) -> None:
        """Attach to the scheduler: the page (with a dashboard) and the metrics."""
        self.scheduler = scheduler
        PLUGINS.add(self)
        try:
            from dask_train.monitor._metrics import register_collector

            register_collector()
        except ImportError:  # no prometheus_client: /metrics says so itself
            pass
        try:
            from dask_train.monitor._page import add_page

            self.page = add_page(scheduler, self)
        except ImportError:  # no bokeh: the scheduler has no dashboard either
            self.page = None

    async def close(self) -> None:
        """Take the page down (the scheduler closes, or the plugin is replaced)."""
        PLUGINS.discard(self)
        if self.page is not None:
            from dask_train.monitor._page import remove_page

            remove_page(self.scheduler, self.page)
            self.page = None

    def log_event(self, topic: str, msg: Any) -> None:
        """Every event on the scheduler comes here: keep dask-train's (cheap for the others)."""
        if isinstance(topic, str) and topic.startswith(PREFIX):
            self.jobs.event(topic, msg, now=time.time())

    def add_worker(self, scheduler: Any, worker: str) -> None:
        """Note a joining worker in the running jobs' logs."""
        now = time.time()
        for view in self.jobs.running():
            view.worker_joined(worker, now=now)

    def remove_client(self, scheduler: Any, client: str) -> None:
        """A client left: its jobs that never said they ended did end."""
        now = time.time()
        for view in self.jobs.running():
            view.client_left(client, now=now)

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        """Note a lost worker in the logs of the running jobs that used it."""
        now = time.time()
        for view in self.jobs.running():
            view.worker_left(worker, now=now)


_warned: set[str] = set()


async def ensure_dashboard(client: Client, *, timeout: float = 10.0) -> None:
    """Register :class:`TrainingDashboard` on ``client``'s scheduler (idempotent; never raises).

    A scheduler that cannot import dask-train (a remote cluster installed without it) cannot
    unpickle the plugin: the job runs without the page, and says so once. Set the Dask config
    ``dask-train.dashboard: false`` to never register it. A scheduler that does not answer within
    ``timeout`` seconds is given up on the same way: the job must not wait for its page.
    """
    if not dask.config.get("dask-train.dashboard", True):
        return
    try:
        registered = client.register_plugin(TrainingDashboard(), name=NAME)
        if inspect.isawaitable(registered):  # the controller calls from the client's loop
            await asyncio.wait_for(registered, timeout)
    except Exception as exc:
        address = str(getattr(client.scheduler, "address", ""))
        if address not in _warned:
            _warned.add(address)
            logger.warning(
                "the Training page and the dask_train_* metrics are off on %s: its scheduler "
                "could not load the dask-train plugin (%s: %s); install dask-train where the "
                "scheduler runs", address, type(exc).__name__, exc)
