"""The Dask config a job's decisions take, read once where its spec is built.

The rules (``policy/_copies.py``) take the values; the controller finds them on the
:class:`~dask_train.engines._spec.JobSpec`.
"""

from __future__ import annotations

import dask

from dask_train.errors import InvalidInput
from dask_train.policy._copies import COPY_EVERY_S, memory_state_problems


def memory_state() -> str:
    """The Dask config ``dask-train.memory-state``
    (:data:`~dask_train.policy._copies.MEMORY_STATE`).

    Raises
    ------
    InvalidInput
        For another value, naming it and the choices.
    """
    value = dask.config.get("dask-train.memory-state", "auto")
    problems = memory_state_problems(value)
    if problems:
        raise InvalidInput(problems)
    return str(value)


def copy_every_s() -> float:
    """The Dask config ``dask-train.copy-every``: seconds between a job's in-memory copies of
    its state (0: none)."""
    return float(dask.config.get("dask-train.copy-every", COPY_EVERY_S) or 0)
