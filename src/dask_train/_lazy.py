"""Lazy public names (PEP 562): a package lists where each name lives; nothing loads until used.

``import dask_train`` must cost what ``import distributed`` costs: torch, scikit-learn, SciPy and
matplotlib load only when a name that needs them is first used, in the client and in every worker
(workers unpickle tasks that import the package).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def attach(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``, whose ``names`` map to module paths.

    A module path starting with ``.`` is relative to ``package``. A name equal to its module's
    last part (``"datasets": ".datasets"``) is the module itself.

    Examples
    --------
    >>> getattr_, dir_, all_ = attach("json", {"dumps": ".decoder"})   # doctest: +SKIP
    """

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where, package) if where.startswith(".") else \
            importlib.import_module(where)
        value = module if where.rsplit(".", 1)[-1] == name else getattr(module, name)
        # Cache on the package: the next access is an ordinary attribute lookup.
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__, sorted(names)
