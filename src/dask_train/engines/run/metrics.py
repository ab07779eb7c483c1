"""What ``ctx.report`` accepts as metrics, checked in the rank's own call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dask_train.errors import InvalidInput

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
