"""Watching jobs from the cluster: the scheduler's Training page and ``dask_train_*`` metrics.

Every fit registers :class:`TrainingDashboard` on the scheduler (idempotent; Dask config
``dask-train.dashboard: false`` turns it off). It builds each job's view from the events the job
publishes and serves it at ``<dashboard>/training`` (linked from the dashboard's top menu) and on
the scheduler's ``/metrics``. Importing this package loads neither Bokeh nor prometheus_client:
the scheduler loads them when the plugin starts.
"""

from __future__ import annotations

from dask_train.monitor._jobs import Jobs, JobView, Series, parse_topic
from dask_train.monitor._live import PAGE
from dask_train.monitor._plugin import NAME, TrainingDashboard, ensure_dashboard

__all__ = ["NAME", "PAGE", "JobView", "Jobs", "Series", "TrainingDashboard", "ensure_dashboard",
           "parse_topic"]
