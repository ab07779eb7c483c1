"""Score records as a pandas history, and a run summary as a plain-text table."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pandas loads when a frame is built, not when a Trainer is
    import pandas as pd


from dask_train.errors import InvalidInput

HISTORY_COLUMNS = ("time_s", "step", "epoch", "samples", "accuracy", "loss", "samples_per_s")

# Keys whose values are rates, printed with thousands separators, and scores printed to 4 decimals.
_RATE_SUFFIXES = ("per_s", "per_second", "_rate")
_SCORE_WORDS = ("accuracy", "score", "f1", "precision", "recall", "auc")


def _check_records(*, records: object) -> None:
    if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Sequence):
        kind = type(records).__name__
        raise InvalidInput([f"records is a {kind}: pass a sequence of mappings (one per score)."])
    problems = [
        f"records[{index}] is a {type(record).__name__}: each record must be a mapping such as "
        "{'time_s': 1.5, 'accuracy': 0.9}."
        for index, record in enumerate(records)
        if not isinstance(record, Mapping)
    ]
    if problems:
        raise InvalidInput(problems)


def ledger_frame(records: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The data ledger's rows as a DataFrame (``FitResult.ledger``)."""
    import pandas as pd

    return pd.DataFrame(list(records))


def history_frame(records: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Turn score records into a history table, one row per record, sorted by time.

    Parameters
    ----------
    records : sequence of mapping
        One mapping per score, as the scorer emits them.

    Returns
    -------
    pandas.DataFrame
        :data:`HISTORY_COLUMNS` first and in that order (NaN where a record lacks one), then any
        other keys in the order first seen, rows sorted by ``time_s`` (stable, NaN last). Empty
        input gives an empty frame with those columns.

    Raises
    ------
    InvalidInput
        If ``records`` is not a sequence of mappings.

    Examples
    --------
    >>> frame = history_frame([{"time_s": 2.0, "loss": 0.3}, {"time_s": 1.0, "lr": 0.1}])
    >>> list(frame.columns)[-2:], frame["time_s"].tolist()
    (['samples_per_s', 'lr'], [1.0, 2.0])
    """
    import pandas as pd

    _check_records(records=records)
    if not records:
        return pd.DataFrame({name: pd.Series(dtype="float64") for name in HISTORY_COLUMNS})
    frame = pd.DataFrame.from_records([dict(record) for record in records])
    extras = [name for name in frame.columns if name not in HISTORY_COLUMNS]
    frame = frame.reindex(columns=[*HISTORY_COLUMNS, *extras])
    frame = frame.sort_values("time_s", kind="stable", na_position="last")
    return frame.reset_index(drop=True)


def _format_float(*, key: str, value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    name = key.lower()
    if name.endswith(_RATE_SUFFIXES) or abs(value) >= 1_000:
        return f"{value:,.1f}"
    if any(word in name for word in _SCORE_WORDS):
        return f"{value:.4f}"
    # Four significant digits: 0.1235 for a loss, 12.35 for seconds, 0.001 for a learning rate.
    return f"{value:.4g}"


def _format_value(*, key: str, value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return "yes" if value else "no"
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    if isinstance(value, numbers.Real):
        return _format_float(key=key, value=float(value))
    if isinstance(value, (Mapping, list, tuple)):
        return json.dumps(value, default=str)
    return str(value)


def summary_table(summary: Mapping[str, Any]) -> str:
    """Format a run summary as a plain-text, two-column table for a terminal.

    Parameters
    ----------
    summary : mapping
        Key to value; keys keep their order. Scores (``accuracy``, ``score``, ...) get 4 decimals,
        rates (``..._per_s``) and large numbers thousands separators, integers separators, other
        floats 4 significant digits.

    Returns
    -------
    str
        One line per key, values aligned in a second column; empty for an empty summary.

    Examples
    --------
    >>> print(summary_table({"accuracy": 0.97123, "samples_per_s": 12345.6, "steps": 1200}))
    accuracy       0.9712
    samples_per_s  12,345.6
    steps          1,200
    """
    keys = [str(key) for key in summary]
    if not keys:
        return ""
    width = max(len(key) for key in keys)
    lines = [
        f"{key:<{width}}  {_format_value(key=key, value=value)}" for key, value in zip(keys, summary.values())
    ]
    return "\n".join(lines)
