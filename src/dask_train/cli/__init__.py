"""Command line: ``dask-train demo``."""

from dask_train.cli.main import main

__all__ = ["main"]
