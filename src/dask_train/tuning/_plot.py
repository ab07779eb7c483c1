"""A PNG of a search: every trial's scores over search time and the best score so far."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from dask_train.tuning._records import TrialRecord, best_so_far

_STYLE = {  # state -> (line style, alpha)
    "complete": ("-", 0.9),
    "pruned": (":", 0.6),
    "interrupted": ("--", 0.6),
}


def plot_search(records: list[TrialRecord], *, metric: str, mode: str, best_score: float,
                path: Path) -> Path:
    """Draw a search's trials into ``path`` (a PNG; parent directories are created), return it.

    One line per trial (solid: complete, dotted: pruned, dashed: interrupted; failed trials
    have no scores), a marker at each trial's last score, and the best score reached so far
    by any trial as a thick step line.
    """
    # A Figure with its own Agg canvas, as report.plot_history: no pyplot state is touched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8.0, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    drawn = 0
    for record in sorted(records, key=lambda r: r.number):
        if not record.points or record.state == "failed":
            continue
        style, alpha = _STYLE.get(record.state, ("-", 0.8))
        times, scores = zip(*record.points)
        ax.plot(times, scores, linestyle=style, alpha=alpha, linewidth=1.0, marker=".",
                markersize=3)
        ax.plot(times[-1:], scores[-1:], marker="o", markersize=4, color="grey", alpha=alpha)
        drawn += 1
    curve = best_so_far(records, mode)
    if len(curve):
        ax.step(curve["time_s"], curve["score"], where="post", color="black", linewidth=2.5,
                label=f"best so far ({best_score:.4g})")
        ax.legend(loc="lower right" if mode == "max" else "upper right")
    else:
        ax.text(0.5, 0.5, "no scores recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("time since the search started (s)")
    ax.set_ylabel(f"held-out {metric}")
    states = ", ".join(f"{n} {s}" for s, n in Counter(r.state for r in records).most_common()) \
        if records else "no trials"
    ax.set_title(f"{drawn} trials with scores ({states})", fontsize=10)
    ax.grid(True, alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    return path
