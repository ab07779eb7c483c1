"""The pure parts of the Training page: topics, series, job views from events, the metrics text.

No cluster: the events are the dicts the controller and the roles publish (their producers are
tested end to end in ``test_watch.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dask_train.monitor import Jobs, Series, TrainingDashboard, parse_topic
from dask_train.monitor._live import PLUGINS
from dask_train.monitor._metrics import TrainingCollector

T0 = 1_000.0


def test_topics_name_the_job_and_generation() -> None:
    assert parse_topic("dask-train-abc123") == ("abc123", None)
    assert parse_topic("dask-train-abc123-g0") == ("abc123", 0)
    assert parse_topic("dask-train-abc123-g12") == ("abc123", 12)
    assert parse_topic("all") is None
    assert parse_topic("tcp://127.0.0.1:1234") is None


def test_series_keeps_the_last_rows_and_counts_them_all() -> None:
    s = Series("x", "y", maxlen=3)
    for i in range(5):
        s.append(x=i, y=10 * i)
    assert s.columns() == {"x": [2, 3, 4], "y": [20, 30, 40]}
    assert s.total == 5
    assert s.since(3) == {"x": [3, 4], "y": [30, 40]}
    assert s.since(0) == {"x": [2, 3, 4], "y": [20, 30, 40]}  # what is left of the older rows
    assert s.since(5) == {"x": [], "y": []}


def _stats(index: int, *, samples: float, feed: float, server: float, step: int) -> dict[str, object]:
    return {"kind": "stats", "role": "trainer", "index": index, "step": step, "interval_s": 1.0,
            "samples": samples, "steps": samples / 100, "feed_wait_s": feed,
            "server_wait_s": server, "worker": f"tcp://w{index}:1"}


def _a_job(jobs: Jobs) -> None:
    """A job as its events arrive: start, two trainers and a server reporting, scores, a lost
    worker, a restart from a checkpoint, a non-finite loss, the end."""
    jobs.event("dask-train-j1", {"kind": "start", "strategy": "async-ps",
                                 "roles": {"trainer": ["tcp://w0:1", "tcp://w1:1"],
                                           "ps": ["tcp://w0:1"], "scorer": ["tcp://w1:1"]}},
               now=T0)
    for second in range(1, 4):
        now = T0 + second
        jobs.event("dask-train-j1-g0", _stats(0, samples=1000, feed=0.1, server=0.2,
                                              step=10 * second), now=now)
        jobs.event("dask-train-j1-g0", _stats(1, samples=500, feed=0.5, server=0.0,
                                              step=10 * second), now=now)
        jobs.event("dask-train-j1-g0", {"kind": "stats", "role": "ps", "index": 0,
                                        "step": 10 * second, "interval_s": 2.0, "updates": 30},
                   now=now)
        jobs.event("dask-train-j1", {"kind": "record", "time_s": second, "step": 10 * second,
                                     "epoch": 0.1 * second, "samples": 1500 * second,
                                     "accuracy": 0.5 + 0.1 * second, "loss": 2.0 / second,
                                     "samples_per_s": 1500.0}, now=now)
    jobs.event("dask-train-j1-g0", {"kind": "block", "trainer": 0, "rows": 5}, now=T0 + 4)
    jobs.event("dask-train-j1", {"kind": "failure", "role": "ps-0", "worker": "tcp://w0:1",
                                 "cause": "worker left", "action": "restart"}, now=T0 + 5)
    jobs.event("dask-train-j1", {"kind": "generation", "generation": 1,
                                 "roles": {"trainer": ["tcp://w1:1", "tcp://w2:1"]}}, now=T0 + 6)
    jobs.event("dask-train-j1-g1", _stats(0, samples=800, feed=0.0, server=0.3, step=40),
               now=T0 + 7)
    jobs.event("dask-train-j1", {"kind": "nonfinite", "role": "trainer-1", "step": 41,
                                 "loss": "nan"}, now=T0 + 7.5)
    jobs.event("dask-train-j1", {"kind": "end", "stopped_by": "StopAfter(8s)"}, now=T0 + 8)


def test_a_job_view_follows_the_events() -> None:
    jobs = Jobs()
    _a_job(jobs)
    view = jobs.latest()
    assert view is not None and view.job_id == "j1"
    assert view.state == "finished" and view.stopped_by == "StopAfter(8s)"
    assert view.generation == 1
    assert view.scores["loss"].columns() == {"time_s": [1.0, 2.0, 3.0], "step": [10, 20, 30],
                                              "value": [2.0, 1.0, 2.0 / 3.0]}
    assert set(view.scores) == {"accuracy", "loss"}  # epoch, samples, rates are not scores
    trainer0 = view.trainers[0].columns()
    assert trainer0["samples_per_s"] == [1000.0, 1000.0, 1000.0, 800.0]
    assert trainer0["data_wait"] == pytest.approx([0.1, 0.1, 0.1, 0.0])
    assert trainer0["server_wait"] == pytest.approx([0.2, 0.2, 0.2, 0.3])
    assert trainer0["steps_per_s"] == [10.0, 10.0, 10.0, 8.0]
    assert view.servers[0].columns()["updates_per_s"] == [15.0, 15.0, 15.0]
    assert view.samples_total == 3 * 1500 + 800
    assert view.updates_total == {0: 90.0}
    assert view.wait_total[(1, "data")] == pytest.approx(1.5)
    assert view.failures == {"restart": 1} and view.nonfinite == 1
    assert view.step == 40  # the latest step a record or a report gave
    kinds = [kind for _, kind, _ in view.log]
    assert kinds == ["start", "failure", "restart", "nonfinite", "end"]
    assert view.log[2][2] == "generation 1 on 2 trainer"


def test_the_jobs_rate_counts_only_trainers_still_reporting() -> None:
    jobs = Jobs()
    _a_job(jobs)
    view = jobs.latest()
    assert view is not None
    # Both trainers reporting: 1000 + 500 once the second one's report is in.
    assert view.throughput.columns()["samples_per_s"][:2] == [1000.0, 1500.0]
    # At the last report (T0 + 7) trainer 1's last report (T0 + 3) is 4 s old: only trainer 0.
    assert view.throughput.columns()["samples_per_s"][-1] == 800.0
    assert view.samples_per_s(T0 + 7) == 800.0
    assert view.samples_per_s(T0 + 60) == 0.0


def test_the_latest_jobs_are_kept_and_a_restarted_id_starts_afresh() -> None:
    jobs = Jobs(keep=2)
    for name in ("a", "b", "c"):
        jobs.event(f"dask-train-{name}", {"kind": "start", "roles": {}}, now=T0)
    assert list(jobs.views) == ["b", "c"]
    jobs.event("dask-train-b", {"kind": "record", "step": 1, "loss": 1.0}, now=T0 + 1)
    jobs.event("dask-train-b", {"kind": "start", "roles": {}}, now=T0 + 2)  # the same id again
    latest = jobs.latest()
    assert latest is not None and latest.job_id == "b" and not latest.scores
    # Stats of a job whose start was missed (the plugin came later) still make a view.
    jobs.event("dask-train-d-g0", _stats(0, samples=10, feed=0, server=0, step=1), now=T0 + 3)
    assert "d" in jobs.views and jobs.views["d"].samples_total == 10


def test_a_job_whose_client_left_has_ended() -> None:
    plugin = TrainingDashboard()
    plugin.log_event("dask-train-k", {"kind": "start", "roles": {}, "client": "Client-1"})
    plugin.log_event("dask-train-m", {"kind": "start", "roles": {}, "client": "Client-2"})
    plugin.remove_client(None, "Client-1")
    assert plugin.jobs.views["k"].state == "failed"
    assert plugin.jobs.views["k"].stopped_by == "its client disconnected"
    assert plugin.jobs.views["m"].state == "running"


def test_events_of_other_topics_are_ignored() -> None:
    jobs = Jobs()
    jobs.event("all", {"action": "add-worker"}, now=T0)
    jobs.event("dask-train-x", "not a dict", now=T0)
    assert not jobs.views


@pytest.fixture
def live_plugin() -> Iterator[TrainingDashboard]:
    plugin = TrainingDashboard()
    PLUGINS.add(plugin)  # what plugin.start does on a scheduler
    yield plugin
    PLUGINS.discard(plugin)


def test_the_metrics_of_a_job(live_plugin: TrainingDashboard) -> None:
    _a_job(live_plugin.jobs)
    registry = CollectorRegistry()
    registry.register(TrainingCollector())
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"job_id": "j1", **labels}.items())))]

    assert value("dask_train_samples_total") == 3 * 1500 + 800
    assert value("dask_train_score", metric="loss") == pytest.approx(2.0 / 3.0)
    assert value("dask_train_score", metric="accuracy") == pytest.approx(0.8)
    assert value("dask_train_running") == 0.0
    assert value("dask_train_generation") == 1.0
    assert value("dask_train_server_updates_total", server="0") == 90.0
    assert value("dask_train_trainer_wait_seconds_total", trainer="1",
                 waiting_for="data") == pytest.approx(1.5)
    assert value("dask_train_failures_total", action="restart") == 1.0
    assert value("dask_train_nonfinite_total") == 1.0
    assert value("dask_train_epoch") == pytest.approx(0.3)
    # The reports are long past (T0 is 1970): no trainer counts as training any more.
    assert value("dask_train_samples_per_second") == 0.0
    assert value("dask_train_trainer_samples_per_second", trainer="0") == 0.0
    assert families["dask_train_samples"].type == "counter"
    assert families["dask_train_score"].type == "gauge"


def test_a_closed_plugin_leaves_the_metrics() -> None:
    plugin = TrainingDashboard()
    PLUGINS.add(plugin)
    _a_job(plugin.jobs)
    registry = CollectorRegistry()
    registry.register(TrainingCollector())
    assert b'job_id="j1"' in generate_latest(registry)  # while the plugin lives
    ref = weakref.ref(plugin)
    del plugin
    assert ref() is None  # the collector holds no plugin alive
    # Its job is gone from the metrics. (Plugins of real jobs run earlier in this process, whose
    # scheduler lives here, may still report theirs.)
    assert b'job_id="j1"' not in generate_latest(registry)


def test_a_page_session_follows_the_latest_job_or_the_one_picked() -> None:
    from bokeh.document import Document

    from dask_train.monitor._page import TrainingPage

    plugin = TrainingDashboard(keep=2)
    page = TrainingPage(plugin)
    Document().add_root(page.root)
    page.update()
    assert "No dask-train job" in page.header.text
    _a_job(plugin.jobs)
    page.update()
    assert "j1" in page.header.text and "finished: StopAfter(8s)" in page.header.text
    loss = page.lines["score-loss"].source
    assert loss.data["y"] == [2.0, 1.0, pytest.approx(2.0 / 3.0)]
    assert len(page.lines["samples-trainer-0"].source.data["x"]) == 4
    assert page.log.data["kind"][0] == "end"  # newest first

    plugin.jobs.event("dask-train-j2", {"kind": "start", "strategy": "sync", "roles": {}}, now=T0)
    plugin.jobs.event("dask-train-j2", {"kind": "record", "step": 5, "loss": 3.0}, now=T0 + 1)
    page.update()  # a new job: the page follows it with new figures
    assert "j2" in page.header.text and "running" in page.header.text
    assert page.lines["score-loss"].source.data["y"] == [3.0]
    plugin.jobs.event("dask-train-j2-g0", _stats(0, samples=500, feed=0, server=0, step=9),
                      now=T0 + 2)
    page.update()  # a sync job has no servers: its ranks' steps are its updates
    assert page.lines["updates-sync"].source.data["y"] == [5.0]
    assert [value for value, _ in page.select.options] == ["", "j2", "j1"]

    page.select.value = "j1"  # what the browser does when the user picks j1
    page.update()
    assert "j1" in page.header.text and len(page.lines["score-loss"].source.data["y"]) == 3
    plugin.jobs.event("dask-train-j3", {"kind": "start", "roles": {}}, now=T0)  # j1 is forgotten
    page.update()
    assert "j3" in page.header.text


def test_the_log_says_how_the_data_reaches_the_trainers() -> None:
    jobs = Jobs()
    why = ("streamed from storage every epoch (data='auto': the data holds 2.3 GiB; 50% of the "
           "2 workers' memory limits (2.4 GiB) is 1.2 GiB: streaming every epoch from storage)")
    jobs.event("dask-train-j2", {"kind": "start", "strategy": "async-ps", "roles": {},
                                 "data": why}, now=T0)
    jobs.event("dask-train-j3", {"kind": "start", "strategy": "sync", "roles": {}}, now=T0)
    views = {v.job_id: v for v in jobs.running()}
    assert [(kind, text) for _, kind, text in views["j2"].log][1:] == [("data", why)]
    assert [kind for _, kind, _ in views["j3"].log] == ["start"]  # no data line: none was said


def test_the_scorers_report_is_its_cpu_not_a_trainers_samples() -> None:
    jobs = Jobs()
    _a_job(jobs)
    view = jobs.latest()
    assert view is not None
    samples, rates = view.samples_total, dict(view.trainer_rate)
    jobs.event("dask-train-j1-g1", {"kind": "stats", "role": "scorer", "index": 0, "step": 41,
                                    "interval_s": 2.0, "cpu_s": 0.5, "cpu_s_total": 1.5,
                                    "scores": 3, "skipped": 4}, now=T0 + 7.8)
    assert view.scorer.columns()["cpu_share"] == [0.25]  # 0.5 CPU-s in 2 s: a quarter core
    assert view.samples_total == samples and view.trainer_rate == rates  # trainer 0 untouched


def test_the_page_states_each_trainers_memory() -> None:
    from bokeh.document import Document

    from dask_train.monitor._page import TrainingPage

    plugin = TrainingDashboard(keep=2)
    page = TrainingPage(plugin)
    Document().add_root(page.root)
    _a_job(plugin.jobs)  # reports without memory figures (a role of an older version): no rows
    page.update()
    assert page.memory.data["trainer"] == []
    memory = {"worker": "tcp://w1:1", "memory_limit": 600 * 2**20, "held_bytes": 8 * 2**20,
              "held_bytes_max": 24 * 2**20, "read_s_by_epoch": [0.5, 0.25]}
    plugin.jobs.event("dask-train-j1-g1", {**_stats(1, samples=10, feed=0, server=0, step=42),
                                           **memory}, now=T0 + 9)
    plugin.jobs.event("dask-train-j1-g1", {**_stats(0, samples=10, feed=0, server=0, step=42),
                                           **memory, "worker": "tcp://w2:1", "memory_limit": 0,
                                           "read_s_by_epoch": []}, now=T0 + 9)
    page.update()
    assert page.memory.data == {
        "trainer": ["0", "1"], "worker": ["tcp://w2:1", "tcp://w1:1"],
        "limit": ["no limit", "600.0 MiB"], "held": ["8.0 MiB", "8.0 MiB"],
        "held_max": ["24.0 MiB", "24.0 MiB"], "read": ["", "0.50, 0.25"]}
