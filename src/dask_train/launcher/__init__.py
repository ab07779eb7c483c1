"""``dt.launch`` / ``dask-train launch``: a script written for torchrun, unchanged, on one rank
per Dask worker, restarted whole after a failure (see ``docs/from-torchrun.md``)."""

from dask_train.launcher._launcher import LaunchResult, launch

__all__ = ["LaunchResult", "launch"]
