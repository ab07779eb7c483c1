"""The Training page: a Bokeh document served by the scheduler's dashboard at ``/training``.

It is added beside distributed's own pages the way distributed adds them
(``distributed.dashboard.scheduler.connect``): a Bokeh server application
(``distributed.dashboard.core.BokehApplication``) appended to the scheduler's HTTP routing
application, under the dashboard's prefix, in the dashboard's template and theme, and linked
from the dashboard's top menu. Each browser session builds its figures for the job it shows and
streams only the points added since its last update (twice a second).
"""

from __future__ import annotations

import functools
import html
import math
import time
from typing import Any

from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, DataRange1d, Range1d
from bokeh.models.annotations import Legend
from bokeh.models.widgets import DataTable, Div, Select, TableColumn
from bokeh.palettes import Category10_10
from bokeh.plotting import figure
from distributed.dashboard.components.scheduler import BOKEH_THEME, env
from distributed.dashboard.core import BokehApplication
from distributed.dashboard.scheduler import template_variables
from distributed.utils import log_errors
from tornado.ioloop import IOLoop

from dask_train.monitor._jobs import MAX_POINTS, JobView, Series
from dask_train.monitor._live import PAGE

_UPDATE_MS = 500
_LATEST: tuple[Any, str] = ("", "the latest job")  # the picker's first choice: follow new jobs
_HEIGHT = 260


def _dashboard(scheduler: Any) -> Any:
    """distributed's own dashboard application (the one serving ``/status``), or None."""
    for app in getattr(getattr(scheduler, "http_application", None), "applications", []):
        if "/status" in getattr(app, "app_paths", ()):
            return app
    return None


def add_page(scheduler: Any, plugin: Any) -> Any:
    """Serve the Training page on ``scheduler``'s dashboard and link it from the top menu.

    Returns the Bokeh application (for :func:`remove_page`), or None without a dashboard.
    """
    dashboard = _dashboard(scheduler)
    if dashboard is None:
        return None
    variables = template_variables(scheduler)  # memoized: the dict every dashboard page reads
    if PAGE not in variables["pages"]:
        variables["pages"].append(PAGE)
    app = BokehApplication({f"/{PAGE}": functools.partial(training_doc, plugin)}, scheduler,
                           prefix=dashboard.prefix, template_variables=variables)
    scheduler.http_application.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    return app


def remove_page(scheduler: Any, app: Any) -> None:
    """Undo :func:`add_page`."""
    applications = scheduler.http_application.applications
    if app in applications:
        applications.remove(app)
    app.stop()
    pages = template_variables(scheduler)["pages"]
    if PAGE in pages:
        pages.remove(PAGE)


@log_errors
def training_doc(plugin: Any, scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
    """Build one browser session's document (distributed's doc-function signature)."""
    page = TrainingPage(plugin)
    page.update()
    doc.add_periodic_callback(page.update, _UPDATE_MS)
    doc.title = "Dask: Training"
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def _figure(title: str, y_label: str, x_range: Any, **kwargs: Any) -> Any:
    fig = figure(title=title, height=_HEIGHT, sizing_mode="stretch_width", x_range=x_range,
                 x_axis_label="seconds since the job started", y_axis_label=y_label,
                 tools="pan,wheel_zoom,box_zoom,reset,save", **kwargs)
    fig.toolbar.logo = None
    # Beside the plot, not over the curves; lines are added to it as they appear.
    fig.add_layout(Legend(items=[], click_policy="hide", label_text_font_size="9pt"), "right")
    return fig


class _Line:
    """A curve on the page: its source, the series it shows, and how much of it was sent."""

    def __init__(self, source: ColumnDataSource, series: Series, y: str) -> None:
        self.source, self.series, self.y, self.seen = source, series, y, 0

    def stream(self) -> None:
        """Send the points added since the last call."""
        if self.series.total > self.seen:
            new = self.series.since(self.seen)
            self.source.stream({"x": new["time_s"], "y": new[self.y]}, rollover=MAX_POINTS)
            self.seen = self.series.total


class TrainingPage:
    """One session's view: a job picker, a headline, five figures and the event log."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        self.job_id: str | None = None
        self.built = False  # figures exist for job_id
        self.follow = True  # show the latest job until the user picks one
        first: list[str | tuple[Any, str]] = [_LATEST]
        self.select = Select(title="Job", value="", options=first, width=420)
        self.select.on_change("value", self._picked)
        self.header = Div(text="", sizing_mode="stretch_width", name="headline")
        self.log = ColumnDataSource({"time_s": [], "kind": [], "text": []}, name="src-log")
        self.table = DataTable(
            source=self.log, height=_HEIGHT, sizing_mode="stretch_width", index_position=None,
            columns=[TableColumn(field="time_s", title="s", width=60),
                     TableColumn(field="kind", title="event", width=90),
                     TableColumn(field="text", title="what happened", width=600)])
        self.memory = ColumnDataSource({c: [] for c in _MEMORY_COLUMNS}, name="src-memory")
        self.memory_table = DataTable(
            source=self.memory, height=120, sizing_mode="stretch_width", index_position=None,
            columns=[TableColumn(field=c, title=title) for c, title in _MEMORY_COLUMNS.items()])
        self.root = column(row(self.select, self.header, sizing_mode="stretch_width"),
                           sizing_mode="stretch_width")
        self.lines: dict[str, _Line] = {}
        self.log_seen = self.memory_seen = -1

    def _picked(self, attr: str, old: Any, new: Any) -> None:
        self.follow = not new
        self.built = False  # rebuilt at the next update

    def _build(self, view: JobView | None) -> None:
        """New figures for the job shown (its lines appear as its series do)."""
        self.job_id = view.job_id if view is not None else None
        self.built = True
        self.lines, self.log_seen, self.memory_seen = {}, -1, -1
        x = DataRange1d()  # one time axis: zooming a plot zooms them all
        self.figures = {
            "loss": _figure("Validation loss", "loss", x),
            "scores": _figure("Validation scores", "score", x),
            "samples": _figure("Samples per second", "samples/s", x),
            "wait": _figure("Time waiting, fraction of each second (dashed: for data; solid: for "
                            "the servers or the all-reduce)", "fraction", x,
                            y_range=Range1d(start=0, end=1.05)),
            "updates": _figure("Parameter updates per second (a sync job's ranks step together)",
                               "updates/s", x),
        }
        f = self.figures
        self.root.children = [
            self.root.children[0],
            row(f["loss"], f["scores"], sizing_mode="stretch_width"),
            row(f["samples"], f["wait"], sizing_mode="stretch_width"),
            row(f["updates"], self.table, sizing_mode="stretch_width"),
            row(self.memory_table, sizing_mode="stretch_width"),
        ]

    def _line(self, name: str, fig: str, label: str, series: Series, y: str, *,
              color: str, dash: str = "solid", points: bool = False) -> None:
        if name in self.lines:
            return
        source = ColumnDataSource({"x": [], "y": []}, name=f"src-{name}")
        plot = self.figures[fig]
        plot.line("x", "y", source=source, color=color, line_dash=dash, line_width=2,
                  legend_label=label)
        if points:
            plot.scatter("x", "y", source=source, color=color, size=5, legend_label=label)
        self.lines[name] = _Line(source, series, y)

    def _add_lines(self, view: JobView) -> None:
        for i, (metric, series) in enumerate(sorted(view.scores.items())):
            self._line(f"score-{metric}", "loss" if metric == "loss" else "scores", metric,
                       series, "value", color=Category10_10[i % 10], points=True)
        self._line("samples-total", "samples", "all trainers", view.throughput,
                   "samples_per_s", color="black")
        for i, series in sorted(view.trainers.items()):
            color = Category10_10[i % 10]
            self._line(f"samples-trainer-{i}", "samples", f"trainer {i}", series,
                       "samples_per_s", color=color)
            self._line(f"wait-data-{i}", "wait", f"trainer {i}, data", series, "data_wait",
                       color=color, dash="dashed")
            self._line(f"wait-servers-{i}", "wait", f"trainer {i}, servers", series,
                       "server_wait", color=color)
        for i, series in sorted(view.servers.items()):
            self._line(f"updates-{i}", "updates", f"server {i}", series, "updates_per_s",
                       color=Category10_10[i % 10])
        if view.info.get("strategy") == "sync" and 0 in view.trainers:
            self._line("updates-sync", "updates", "all ranks", view.trainers[0], "steps_per_s",
                       color="black")

    @log_errors
    def update(self) -> None:
        """Follow the chosen (or latest) job and stream its new points."""
        jobs = self.plugin.jobs
        self._update_select(jobs)
        if not self.follow and self.select.value not in jobs.views:
            self.follow = True  # the picked job was forgotten (only the latest are kept)
        view = jobs.latest() if self.follow else jobs.views[self.select.value]
        if not self.built or (view.job_id if view is not None else None) != self.job_id:
            self._build(view)
        self.header.text = _headline(view, now=time.time())
        if view is None:
            return
        self._add_lines(view)
        for line in self.lines.values():
            line.stream()
        if view.log_total != self.log_seen:
            rows = list(reversed(view.log))  # newest first
            self.log.data = {"time_s": [r[0] for r in rows], "kind": [r[1] for r in rows],
                             "text": [r[2] for r in rows]}
            self.log_seen = view.log_total
        if view.memory_seen != self.memory_seen:
            self.memory.data = memory_rows(view)
            self.memory_seen = view.memory_seen

    def _update_select(self, jobs: Any) -> None:
        options: list[str | tuple[Any, str]] = [_LATEST]
        options += [(v.job_id, f"{v.job_id} · {v.info.get('strategy', '?')} · {v.state}")
                    for v in reversed(jobs.views.values())]
        if options != self.select.options:
            self.select.options = options


#: The memory table's columns (each trainer's last report): field -> title.
_MEMORY_COLUMNS = {"trainer": "trainer", "worker": "worker", "limit": "worker memory limit",
                   "held": "its blocks held now", "held_max": "its blocks held at most",
                   "read": "its read time per epoch (s)"}


def _size(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return ""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_rows(view: JobView) -> dict[str, list[str]]:
    """The memory table: each trainer's worker and its memory limit, the bytes of blocks the
    trainer holds now and held at most, and its read time per epoch (streamed data)."""
    rows = sorted(view.memory.items())
    return {"trainer": [str(i) for i, _ in rows],
            "worker": [str(m.get("worker") or "") for _, m in rows],
            "limit": [_size(m.get("memory_limit")) if m.get("memory_limit") else "no limit"
                      for _, m in rows],
            "held": [_size(m.get("held_bytes")) for _, m in rows],
            "held_max": [_size(m.get("held_bytes_max")) for _, m in rows],
            "read": [", ".join(f"{s:.2f}" for s in m.get("read_s_by_epoch") or []) for _, m in rows]}


def _headline(view: JobView | None, *, now: float) -> str:
    if view is None:
        return ("<p>No dask-train job has run on this cluster yet: start one with "
                "<code>dt.Trainer(...).fit(...)</code>.</p>")
    s = view.summary(now)
    state = {"running": "running", "finished": f"finished: {s['stopped_by']}",
             "failed": f"failed: {s['stopped_by']}"}[s["state"]]
    parts = [f"<b>{html.escape(s['job_id'])}</b>", html.escape(str(s["strategy"])),
             html.escape(state), f"step {s['step']:,}", f"{s['samples']:,.0f} samples"]
    if not math.isnan(s["epoch"]):
        parts.append(f"epoch {s['epoch']:.2f}")
    if s["state"] == "running":
        parts.append(f"{s['samples_per_s']:,.0f} samples/s")
    parts += [f"{html.escape(k)} {v:.4g}" for k, v in sorted(s["scores"].items())
              if not math.isnan(v)]
    parts.append(f"generation {s['generation']}, {s['failures']} failures, "
                 f"{s['nonfinite']} non-finite")
    return f"<p style='font-size:14px'>{' &middot; '.join(parts)}</p>"
