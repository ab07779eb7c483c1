"""The jobs' figures as Prometheus metrics on the scheduler's existing ``/metrics`` endpoint.

distributed serves ``/metrics`` from ``prometheus_client``'s global registry (its own collectors
are registered there the first time the endpoint is read), so one collector registered there,
once per process, adds ``dask_train_*`` families beside ``dask_scheduler_*``. It reads the live
plugins' jobs at each scrape; nothing is kept twice.

Every series carries ``job_id`` (not ``job``: Prometheus itself sets ``job`` on every target).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dask_train.monitor._jobs import RATE_FRESH_S
from dask_train.monitor._live import PLUGINS

_lock = threading.Lock()
_registered = False


def register_collector() -> None:
    """Add the dask-train collector to the global registry (once per process)."""
    global _registered
    with _lock:
        if not _registered:
            prometheus_client.REGISTRY.register(TrainingCollector())
            _registered = True


class TrainingCollector:
    """Yields the ``dask_train_*`` families of every job the live plugins remember."""

    def describe(self) -> list[Any]:
        """Nothing to check at registration: the families depend on the jobs seen."""
        return []

    def collect(self) -> Iterator[Any]:
        """One family per figure, one series per job (and trainer, server, metric, action)."""
        now = time.time()
        views = [view for plugin in list(PLUGINS) for view in plugin.jobs.views.values()]
        job = ["job_id"]
        samples = CounterMetricFamily("dask_train_samples", "Training samples processed by the "
                                      "trainers (summed from their reports)", labels=job)
        rate = GaugeMetricFamily("dask_train_samples_per_second", "Samples per second of all "
                                 "trainers over their last reports", labels=job)
        step = GaugeMetricFamily("dask_train_step", "The job's latest step (parameter updates)",
                                 labels=job)
        epoch = GaugeMetricFamily("dask_train_epoch", "Epochs trained at the latest score",
                                  labels=job)
        score = GaugeMetricFamily("dask_train_score", "The latest validation score",
                                  labels=[*job, "metric"])
        running = GaugeMetricFamily("dask_train_running", "1 while the job runs", labels=job)
        generation = GaugeMetricFamily("dask_train_generation", "The job's generation (0, then "
                                       "one more per restart from a checkpoint)", labels=job)
        trainer_rate = GaugeMetricFamily("dask_train_trainer_samples_per_second", "A trainer's "
                                         "samples per second over its last report (0 once "
                                         "it stopped reporting)",
                                         labels=[*job, "trainer"])
        wait = CounterMetricFamily("dask_train_trainer_wait_seconds", "Seconds a trainer waited "
                                   "for data or for the servers (all-reduce in sync jobs)",
                                   labels=[*job, "trainer", "waiting_for"])
        updates = CounterMetricFamily("dask_train_server_updates", "Updates a parameter-server "
                                      "shard applied", labels=[*job, "server"])
        failures = CounterMetricFamily("dask_train_failures", "Lost or failed roles, by the "
                                       "action taken", labels=[*job, "action"])
        nonfinite = CounterMetricFamily("dask_train_nonfinite", "Non-finite losses or scores",
                                        labels=job)
        for view in views:
            j = [view.job_id]
            summary = view.summary(now)
            samples.add_metric(j, view.samples_total)
            step.add_metric(j, view.step)
            running.add_metric(j, 1.0 if view.state == "running" else 0.0)
            generation.add_metric(j, view.generation)
            nonfinite.add_metric(j, view.nonfinite)
            for value, family in ((summary["samples_per_s"], rate), (summary["epoch"], epoch)):
                if not math.isnan(value):
                    family.add_metric(j, value)
            for name, value in summary["scores"].items():
                if not math.isnan(value):
                    score.add_metric([*j, name], value)
            for index, (value, when) in sorted(view.trainer_rate.items()):
                # 0 once the trainer stopped reporting (ended, lost), like the job's rate.
                fresh = now - when <= RATE_FRESH_S
                trainer_rate.add_metric([*j, str(index)], value if fresh else 0.0)
            for (index, what), seconds in sorted(view.wait_total.items()):
                wait.add_metric([*j, str(index), what], seconds)
            for index, total in sorted(view.updates_total.items()):
                updates.add_metric([*j, str(index)], total)
            for action, count in sorted(view.failures.items()):
                failures.add_metric([*j, action], count)
        yield from (samples, rate, step, epoch, score, running, generation, trainer_rate, wait,
                    updates, failures, nonfinite)
