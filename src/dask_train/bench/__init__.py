"""Measuring training on a cluster: the multi-host harness, the throughput grid, its outputs.

* :class:`NetnsCluster`: a scheduler and worker "hosts" on one Linux machine, each in its own
  network namespace with its own address and a ``tc``-shaped link, running the real ``dask
  scheduler`` / ``dask worker`` programs (needs root);
* :class:`Grid` and :func:`run_grid`: async-ps throughput over workers x parameter servers x model
  sizes (x link rates), with the cost model (:mod:`dask_train.policy._cost`) calibrated on a few
  of the points; what ``dask-train bench`` runs.

Light at import: torch, matplotlib and Dask's client load where they are used.

Examples
--------
>>> from dask_train.bench import Link, NetnsCluster
>>> with NetnsCluster(n_workers=4, link=Link(rate_mbit=1000)) as cluster:   # doctest: +SKIP
...     client = dt.connect(cluster.scheduler_address)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask_train.bench._netns import (
    HarnessUnavailable,
    Link,
    NetnsCluster,
    cleanup_leftovers,
    netem_available,
    unavailable_reason,
)

if TYPE_CHECKING:
    from dask_train.bench._grid import Grid, run_grid


def __getattr__(name: str) -> Any:
    # The grid needs torch: loaded on first use of its names only.
    if name in ("Grid", "run_grid"):
        from dask_train.bench import _grid

        return getattr(_grid, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Grid", "HarnessUnavailable", "Link", "NetnsCluster", "cleanup_leftovers",
           "netem_available", "run_grid", "unavailable_reason"]
