"""The public API on top of every layer: :class:`Trainer` and its :class:`FitResult`, and
:func:`run` (the user's own training function) and its :class:`RunResult`. Names load lazily:
:func:`run` never imports torch in the client (the ranks do), which saved a ``dt.run`` script a
second of start-up.
"""

from typing import TYPE_CHECKING

from dask_train._lazy import attach

__getattr__, __dir__, _ = attach(__name__, {
    "FitResult": "._result",
    "run": "._run",
    "RunResult": "._run_result",
    "Trainer": "._trainer",
})
__all__ = ["FitResult", "RunResult", "Trainer", "run"]

if TYPE_CHECKING:  # static names for type checkers and IDEs
    from dask_train.api._result import FitResult
    from dask_train.api._run import run
    from dask_train.api._run_result import RunResult
    from dask_train.api._trainer import Trainer
