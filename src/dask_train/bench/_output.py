"""What ``dask-train bench`` writes: a printed table, a CSV, a PNG plot and the ps recommendations."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dask_train.bench._grid import GroupResult

COLUMNS = ("model", "params", "link_mbit", "workers", "ps", "samples_per_s", "steps_per_s",
           "ps_wait", "predicted_samples_per_s", "error", "calibration_point", "bottleneck")
#: Worker counts the recommendation table looks at, up to a thousand.
SCALE = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000)


def rows_of(groups: Sequence[GroupResult]) -> list[dict[str, Any]]:
    return [row for group in groups for row in group.rows]


def _cell(value: Any, column: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if column in ("samples_per_s", "predicted_samples_per_s"):
        return f"{value:,.0f}"
    if column == "steps_per_s":
        return f"{value:.2f}"
    if column in ("ps_wait", "error"):
        return f"{value:+.0%}" if column == "error" else f"{value:.0%}"
    if column == "link_mbit":
        return f"{value:g}"
    if column == "params":
        return f"{value:,}"
    if column == "calibration_point":
        return "yes" if value else ""
    return str(value)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] = COLUMNS) -> str:
    """A markdown table of the measured (and predicted) rows, columns that hold values only."""
    used = [c for c in columns if any(_cell(r.get(c), c) for r in rows)]
    lines = ["| " + " | ".join(used) + " |", "|" + "|".join("---" for _ in used) + "|"]
    lines += ["| " + " | ".join(_cell(r.get(c), c) for c in used) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS) + ["seconds", "steps", "wall_s"],
                                extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_json(groups: Sequence[GroupResult], path: Path, **extra: Any) -> Path:
    """Every group's rows and its probed and calibrated cost models (to re-fit them later)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = [{"model": list(g.model), "link_mbit": g.link_mbit, "rows": g.rows,
             "probed": dataclasses.asdict(g.probed),
             "calibrated": dataclasses.asdict(g.calibrated) if g.calibrated else None}
            for g in groups]
    path.write_text(json.dumps({**extra, "groups": data}, indent=2, default=_plain) + "\n")
    return path


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def recommendations(groups: Sequence[GroupResult], scale: Sequence[int] = SCALE
                    ) -> list[dict[str, Any]]:
    """For each group, the ps the calibrated model recommends at each worker count.

    Extrapolated to a cluster that grows by adding hosts like the measured ones: each role on a
    host of its own with the measured link, and the cores of one Dask worker each (so the
    shared cores of an emulated cluster no longer limit it).
    """
    out = []
    for group in groups:
        model = group.calibrated or group.probed
        if model is None:
            continue
        grown = model.replace(hosts=None, shared_cores=None, cores_per_host=1.0)
        for w in scale:
            rec = grown.recommend_ps(workers=w, max_ps=max(w, 1))
            one = rec.candidates[0]
            out.append({"model": "-".join(map(str, group.model)), "link_mbit": group.link_mbit,
                        "workers": w, "best_ps": rec.ps,
                        "samples_per_s": rec.predicted.samples_per_s,
                        "ps1_samples_per_s": one.samples_per_s,
                        "bottleneck": rec.predicted.bottleneck})
    return out


def recommendation_table(recs: Sequence[dict[str, Any]]) -> str:
    lines = ["| model | link Mbit/s | workers | recommended ps | predicted samples/s | with ps=1 "
             "| limited by |", "|---|---|---|---|---|---|---|"]
    for r in recs:
        link = "" if r["link_mbit"] is None else f"{r['link_mbit']:g}"
        lines.append(f"| {r['model']} | {link} | {r['workers']} | {r['best_ps']} | "
                     f"{r['samples_per_s']:,.0f} | {r['ps1_samples_per_s']:,.0f} | {r['bottleneck']} |")
    return "\n".join(lines)


def plot(groups: Sequence[GroupResult], path: Path, *, title: str = "") -> Path:
    """Throughput against workers, one line per ps count, one panel per model and link rate.

    Measured points are solid lines with markers; the calibrated model's predictions, where
    there are any, dashed lines of the same colour.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    panels = [g for g in groups if g.rows]
    fig = Figure(figsize=(5.0 * max(len(panels), 1), 4.0), dpi=100)
    axes = fig.subplots(1, max(len(panels), 1), squeeze=False)[0]
    for ax, group in zip(axes, panels):
        for i, ps in enumerate(sorted({r["ps"] for r in group.rows})):
            rows = sorted((r for r in group.rows if r["ps"] == ps), key=lambda r: r["workers"])
            xs = [r["workers"] for r in rows]
            color = f"C{i}"
            ax.plot(xs, [r["samples_per_s"] for r in rows], marker="o", color=color,
                    label=f"ps={ps}")
            if all("predicted_samples_per_s" in r for r in rows):
                ax.plot(xs, [r["predicted_samples_per_s"] for r in rows], linestyle="--",
                        color=color, alpha=0.7)
        link = "" if group.link_mbit is None else f", {group.link_mbit:g} Mbit/s links"
        ax.set_title(f"MLP {'-'.join(map(str, group.model))}{link}", fontsize=10)
        ax.set_xlabel("workers (trainers)")
        ax.set_ylabel("samples/s")
        ax.set_xticks(sorted({r["workers"] for r in group.rows}))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(title="measured (solid), model (dashed)", fontsize=8, title_fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
