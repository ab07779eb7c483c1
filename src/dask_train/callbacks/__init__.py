"""Callbacks a fit can take: the base class, a history keeper, TensorBoard summaries and MLflow
tracking.

Every hook is called by the controller in the client process (see
:class:`~dask_train.policy.callbacks.Callback`). Importing this module loads neither torch,
TensorBoard nor MLflow: :class:`TensorBoard` loads the ``tensorboard`` package when a fit opens
its file, :class:`MLflow` loads ``mlflow`` when a fit starts.

Examples
--------
>>> import dask_train as dt
>>> cb = dt.callbacks.TensorBoard("runs/exp1")
>>> isinstance(cb, dt.callbacks.Callback)
True
"""

from __future__ import annotations

from dask_train.callbacks._mlflow import MLflow
from dask_train.callbacks._tensorboard import TensorBoard
from dask_train.policy.callbacks import Callback, History

__all__ = ["Callback", "History", "MLflow", "TensorBoard"]
