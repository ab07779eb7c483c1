"""Hyper-parameter search on the cluster: trials as jobs on reserved gangs of workers, optuna's
samplers and pruners, failures and Ctrl-C handled (``dt.search``)."""

from dask_train.tuning._gangs import Reservations
from dask_train.tuning._result import SearchResult
from dask_train.tuning._search import search
from dask_train.tuning._space import Range, Space, intuniform, loguniform, uniform

__all__ = [
    "Range",
    "Reservations",
    "SearchResult",
    "Space",
    "intuniform",
    "loguniform",
    "search",
    "uniform",
]
