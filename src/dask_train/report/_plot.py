"""A PNG of a training history, drawn without pyplot so a user's notebook state is left alone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from dask_train.errors import InvalidInput

# matplotlib (about 0.5 s) loads in plot_history only: the controller imports this package for
# its history table, and most runs never draw.
if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

_PANEL_HEIGHT_IN = 3.0
_WIDTH_IN = 8.0
_DPI = 100


def _has_values(*, history: pd.DataFrame, column: str) -> bool:
    return column in history.columns and bool(history[column].notna().any())


def _draw_panel(*, ax: Axes, history: pd.DataFrame, column: str, label: str, best: str) -> None:
    if not _has_values(history=history, column=column):
        ax.text(0.5, 0.5, f"no {label} recorded", ha="center", va="center", transform=ax.transAxes)
    else:
        points = history[["time_s", column]].dropna()
        # Markers only for short histories, where a bare line would hide how few points there are.
        marker = "o" if len(points) <= 30 else None
        ax.plot(points["time_s"], points[column], marker=marker, markersize=3, linewidth=1.5)
        # Accuracy to 4 decimals, as the summary table prints it; a loss to 4 significant digits.
        if best == "max":
            ax.set_title(f"{label} (best {points[column].max():.4f})", fontsize=10)
        else:
            ax.set_title(f"{label} (lowest {points[column].min():.4g})", fontsize=10)
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)


def plot_history(history: pd.DataFrame, path: str | os.PathLike[str]) -> Path:
    """Draw held-out accuracy and loss against time into a PNG file.

    Two panels share the time axis: accuracy (left out when the history has none) and loss.

    Parameters
    ----------
    history : pandas.DataFrame
        A frame from :func:`history_frame` (needs ``time_s`` when it has rows).
    path : str or os.PathLike
        Where to write the PNG; parent directories are created.

    Returns
    -------
    pathlib.Path
        The written file.

    Raises
    ------
    InvalidInput
        If ``history`` is not a DataFrame or has rows but no ``time_s`` column.

    Examples
    --------
    >>> import tempfile
    >>> from dask_train.report import history_frame
    >>> frame = history_frame([{"time_s": 1.0, "loss": 0.5}, {"time_s": 2.0, "loss": 0.3}])
    >>> plot_history(frame, tempfile.mkdtemp() + "/scores.png").suffix
    '.png'
    """
    import pandas as pd

    if not isinstance(history, pd.DataFrame):
        kind = type(history).__name__
        raise InvalidInput([f"history is a {kind}: pass the DataFrame from history_frame()."])
    if len(history) and "time_s" not in history.columns:
        raise InvalidInput(["history has no 'time_s' column: build it with history_frame()."])
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [("loss", "loss", "min")]
    if _has_values(history=history, column="accuracy"):
        panels.insert(0, ("accuracy", "held-out accuracy", "max"))
    # A Figure with its own Agg canvas: no pyplot, so no global backend switch and no figure
    # registered in a notebook's pyplot state.
    figure = Figure(figsize=(_WIDTH_IN, _PANEL_HEIGHT_IN * len(panels) + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (column, label, best) in zip(axes, panels):
        _draw_panel(ax=ax, history=history, column=column, label=label, best=best)
    axes[-1].set_xlabel("time (s)")
    figure.suptitle("Training history")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, format="png", dpi=_DPI)
    return target
