"""What the scheduler runs to say whether it can import dask-train (``Client.run_on_scheduler``).

Recent distributed unpickles every task graph on the scheduler, and a fit's graphs name
dask-train's functions: a scheduler that cannot import dask-train fails the first fit with Dask's
"Error during deserialization of the task graph". Dask's own ``get_versions`` reads installed
package metadata, which an environment may hold for a package it cannot import (an editable
install whose source is not there, a site-packages copied without its ``.pth`` files); this
probe imports dask-train for real.

cloudpickle sends this module's functions by value (see :func:`scheduler_dask_train`), so a
scheduler without dask-train can unpickle and run the probe that says so: keep it free of
dask-train's imports.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


def dask_train_here() -> dict[str, str | None]:
    """dask-train's version as this process imports it, or why it cannot (run on the scheduler).

    Examples
    --------
    >>> dask_train_here()["error"] is None
    True
    """
    try:
        # By name: the package is what this asks about, and runtime imports no layer above it.
        package = importlib.import_module("dask_train")
    except Exception as exc:  # any failure to import is the answer, not an error of the probe
        return {"version": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"version": str(getattr(package, "__version__", "unknown")), "error": None}


def scheduler_dask_train(client: Any) -> dict[str, str | None]:
    """Run :func:`dask_train_here` on ``client``'s scheduler (one round trip)."""
    import cloudpickle

    # By value: unpickling a function by reference imports its module, which is what a scheduler
    # without dask-train cannot do.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    result: dict[str, str | None] = client.run_on_scheduler(dask_train_here)
    return result
