"""What the scheduler plugin shares with the two views it serves: the page's path, and the plugins
alive in this process.

Below :mod:`._plugin` (which registers itself here and starts the views), :mod:`._page` (which
serves :data:`PAGE`) and :mod:`._metrics` (which reads every live plugin's jobs at each scrape),
so neither view imports the plugin's module.
"""

from __future__ import annotations

import weakref
from typing import Protocol

from dask_train.monitor._jobs import Jobs

#: The page's path under the dashboard's prefix.
PAGE = "training"


class HoldsJobs(Protocol):
    """What the views read from a plugin: the jobs it remembers."""

    jobs: Jobs


# Every plugin alive in this process: the Prometheus collector reads them (one process may host
# several schedulers, as in tests). Weak: a closed plugin's jobs leave the metrics with it.
PLUGINS: weakref.WeakSet[HoldsJobs] = weakref.WeakSet()
