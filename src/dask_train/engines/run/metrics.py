"""What ``ctx.report`` accepts as metrics, checked in the rank's own call, and what the
frameworks' report callbacks (Lightning's, Hugging Face's) take from their logs."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from dask_train.errors import InvalidInput

logger = logging.getLogger(__name__)

REDUCTIONS = (None, "mean", "sum", "min", "max")
#: Columns every history record has from the job itself (see controller._history).
HISTORY_COLUMNS = frozenset({"time_s", "step", "epoch", "samples", "samples_per_s", "worker"})


def numbers(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """The metrics as floats; a clear error for anything else."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidInput([f"ctx.report(metrics={type(metrics).__name__}): pass a dict of "
                            "name -> number."])
    taken = sorted(set(map(str, metrics)) & HISTORY_COLUMNS)
    if taken:
        raise InvalidInput([f"ctx.report(metrics) names {taken}, which the job's history sets "
                            "itself (the step, epoch and samples the job counted): report them "
                            "under another name, e.g. 'my_epoch'."])
    out: dict[str, float] = {}
    for name, value in metrics.items():
        item = getattr(value, "item", None)
        try:
            out[str(name)] = float(item() if callable(item) else value)
        except (TypeError, ValueError):
            raise InvalidInput([f"ctx.report(metrics[{name!r}]={value!r}): a metric is a number "
                                "(or a one-element tensor)."]) from None
    return out


def check_report_options(ctx: Any, metrics: Any, reduce: Any, checkpoint: Any) -> None:
    """What a framework's report callback (``dt.lightning.Report``, ``dt.huggingface.Report``)
    is given, checked when the user makes it: every problem at once, before any training."""
    problems = []
    if not callable(getattr(ctx, "report", None)):
        problems.append(f"Report(ctx={ctx!r}): pass the ctx your dt.run function received.")
    if isinstance(metrics, str):
        problems.append(f"Report(metrics={metrics!r}): pass a list of names.")
    if reduce not in REDUCTIONS:
        problems.append(f"Report(reduce={reduce!r}): use one of {REDUCTIONS}.")
    if not isinstance(checkpoint, bool):
        problems.append(f"Report(checkpoint={checkpoint!r}): pass True or False.")
    if problems:
        raise InvalidInput(problems)


def logged_numbers(logged: Mapping[str, Any] | None,
                   wanted: Collection[str] | None) -> dict[str, float]:
    """The one-number entries of what a framework logged (a Lightning ``callback_metrics``, a
    Hugging Face ``logs``), as floats, NaN ones too (the job's ``on_nan`` decides about them):
    only the ``wanted`` names when given, never a history column (the framework's own ``step``
    or ``epoch``: the job's history keeps its own, and ``ctx.report`` refuses those names)."""
    out: dict[str, float] = {}
    for name, value in dict(logged or {}).items():
        if name in HISTORY_COLUMNS or (wanted is not None and name not in wanted):
            continue
        item = getattr(value, "item", None)
        if callable(item) and getattr(value, "numel", lambda: 1)() == 1:
            value = item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[str(name)] = float(value)
        else:
            logger.debug("Report: %s=%r is not a number; not reported", name, value)
    return out
