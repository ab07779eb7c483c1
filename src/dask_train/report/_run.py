"""One directory per training run: summary, history, plot and model, ready to share."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dask_train.checkpoint import save_module
from dask_train.report._plot import plot_history

if TYPE_CHECKING:  # the module argument arrives with torch loaded; only its hint needs the name
    import pandas as pd
    import torch


def _jsonable(value: Any) -> Any:
    """Plain JSON types; NaN and infinities become null, which strict JSON readers accept."""
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(item) for item in value]
    if isinstance(value, (np.ndarray, np.generic)):
        return _jsonable(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def write_run(
    out_dir: str | os.PathLike[str],
    *,
    history: pd.DataFrame,
    summary: Mapping[str, Any],
    module: torch.nn.Module,
) -> dict[str, Path]:
    """Write a run's results into one directory.

    Parameters
    ----------
    out_dir : str or os.PathLike
        Directory to create (with parents) or reuse; files of the same names are replaced.
    history : pandas.DataFrame
        The history from :func:`history_frame`.
    summary : mapping
        Final figures of the run; numpy values are converted, NaN is written as null.
    module : torch.nn.Module
        The trained model.

    Returns
    -------
    dict of str to pathlib.Path
        ``"summary"`` (summary.json, indent 2, sorted keys), ``"history"`` (history.csv),
        ``"scores"`` (scores.png) and ``"model"`` (model.safetensors, see
        :func:`dask_train.checkpoint.load_module`).

    Examples
    --------
    >>> import tempfile, torch
    >>> from dask_train.report import history_frame
    >>> history = history_frame([{"time_s": 1.0, "accuracy": 0.9, "loss": 0.4}])
    >>> paths = write_run(tempfile.mkdtemp(), history=history, summary={"accuracy": 0.9},
    ...                   module=torch.nn.Linear(64, 10))
    >>> sorted(paths)
    ['history', 'model', 'scores', 'summary']
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "summary": out / "summary.json",
        "history": out / "history.csv",
        "scores": out / "scores.png",
        "model": out / "model.safetensors",
    }
    text = json.dumps(_jsonable(summary), indent=2, sort_keys=True)
    paths["summary"].write_text(text + "\n", encoding="utf-8")
    history.to_csv(paths["history"], index=False)
    plot_history(history, paths["scores"])
    save_module(module, paths["model"])
    return paths
