"""Reports of a training run: the history table, its plot, a summary table, and a run directory.

Examples
--------
>>> from dask_train.report import history_frame, summary_table
>>> history = history_frame([{"time_s": 1.0, "accuracy": 0.95, "loss": 0.2}])
>>> print(summary_table({"accuracy": 0.95}))
accuracy  0.9500
"""

from dask_train.report._history import HISTORY_COLUMNS, history_frame, ledger_frame, summary_table
from dask_train.report._plot import plot_history
from dask_train.report._run import write_run

__all__ = [
    "HISTORY_COLUMNS", "history_frame", "ledger_frame", "plot_history", "summary_table", "write_run",
]
