"""The engines by name: what the api builds a job's engine from, and how its roles are laid.

An entry names its engine class by import path, so only the engine a job runs is imported
(importing it also registers its worker-side RPC handlers). Adding an engine is one entry here.
Every job's engine is found here, the numpy ``ArrayModel``'s too (``"array"``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineEntry:
    """One engine: its name, where its class is, and how its roles are laid out.

    ``strategy``: the ``strategy=`` value a job of this engine reports (``FitResult.plan``,
    the checkpoint manifest's ``"strategy"``, the Training page, the failure messages): its
    name, but for the numpy engine, which users ask for with ``strategy="sync"`` and whose
    checkpoints have always said ``"sync"`` (a checkpoint written before keeps loading as one).
    ``servers``: whether it places parameter servers (async-ps); ``one_rank_per_worker``:
    whether each trainer is a rank of torch's default process group, of which a process has
    one (so at most one trainer per Dask worker, and a new generation takes as many ranks as
    there are workers left, up to its own).
    """

    name: str
    path: str
    servers: bool = False
    one_rank_per_worker: bool = False
    reported_as: str | None = None

    @property
    def strategy(self) -> str:
        """The strategy a job of this engine reports (see the class docstring)."""
        return self.reported_as or self.name

    def engine_class(self) -> Any:
        """The engine class (imported now)."""
        module, name = self.path.split(":")
        return getattr(importlib.import_module(module), name)


ENGINES: dict[str, EngineEntry] = {e.name: e for e in (
    EngineEntry("async-ps", "dask_train.engines.ps.engine:AsyncPSEngine", servers=True),
    EngineEntry("sync", "dask_train.engines.torch_sync.engine:TorchSyncEngine",
                one_rank_per_worker=True),
    EngineEntry("run", "dask_train.engines.run.engine:RunEngine", one_rank_per_worker=True),
    EngineEntry("array", "dask_train.engines.array.engine:ArrayEngine", reported_as="sync"),
)}


def engine_entry(strategy: str) -> EngineEntry:
    """The registry's entry for the engine named ``strategy`` (a Trainer's torch strategies,
    ``"run"`` and ``"array"``).

    Raises
    ------
    KeyError
        For a strategy no engine runs (the api refuses those before building anything).
    """
    try:
        return ENGINES[strategy]
    except KeyError:
        raise KeyError(f"no engine runs strategy={strategy!r}: one of {sorted(ENGINES)}") from None
