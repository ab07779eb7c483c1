"""Imported by the embedded cluster's fork server, after torch (see :mod:`dask_train.runtime._fork`).

It imports what ``dt.run``'s function will import on each rank, read from ``IMPORTS_ENV``
(``"module"`` or ``"module:name,name"``), so every worker forked from the server starts with it:
imported once for all of them rather than by each (Hugging Face's ``Trainer``: 3.2 s of CPU a
rank). The variable goes from the environment here, so the workers do not inherit it.
"""

import importlib
import json
import os


def _import_all(entries: str) -> None:
    for entry in json.loads(entries):
        module, _, names = str(entry).partition(":")
        try:
            imported = importlib.import_module(module)
            for name in filter(None, names.split(",")):
                getattr(imported, name, None)  # a package's lazily imported name
        except Exception:  # noqa: BLE001, S110 - a rank imports it itself, where its error shows
            pass


_import_all(os.environ.pop("DASK_TRAIN_FORK_IMPORTS", "[]"))
