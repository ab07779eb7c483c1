"""The checks of ``dt.run``'s function and named data sets, before any work: each lists its
problems (every one, with its fix) rather than raising."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np

from dask_train.data._hf_datasets import as_arrays, kind_of
from dask_train.errors import InvalidInput


def check_fn(fn: Any, config: Any) -> list[str]:
    """Problems with the function and its ``config`` (a call ``fn(ctx, **config)`` binds)."""
    if not callable(fn):
        return [f"fn={fn!r} is not callable: pass the training function, def train(ctx, ...)."]
    if config is not None and not (isinstance(config, Mapping) and
                                   all(isinstance(k, str) for k in config)):
        return [f"config={config!r} is invalid: pass a dict of the function's keyword arguments."]
    try:
        inspect.signature(fn).bind(None, **dict(config or {}))
    except TypeError as exc:
        name = getattr(fn, "__name__", repr(fn))
        return [f"{name}(ctx, **config) cannot be called with config={dict(config or {})!r} "
                f"({exc}): the function takes ctx first, then the config's keys as arguments."]
    except ValueError:  # a builtin without a signature: it is called as it is
        pass
    return []


def check_data_sets(data: Any) -> list[str]:
    """Problems with ``data=``: a dict of named sets, each readable as (X, y) or X."""
    if data is None:
        return []
    kind = kind_of(data)
    if kind is not None:
        return [f"data is a datasets.{kind}: pass its splits by name, data={{'train': "
                "dd['train'], 'val': dd['test']} (the first is streamed to the ranks, the others "
                "go whole to every rank)."]
    if not isinstance(data, Mapping) or not data or not all(isinstance(k, str) for k in data):
        return [f"data={type(data).__name__} is invalid: pass a dict of named data sets, "
                "{'train': (X, y)} (the first is streamed to the ranks)."]
    from dask_train.data._blocks import as_dask_array
    from dask_train.data._checks import check_data
    from dask_train.data._training import TrainingData

    problems = []
    for name, value in data.items():
        if isinstance(value, TrainingData):  # the streamed set, read once (data_sets)
            paired = value.with_targets()  # zeros for a set given without targets
            problems += [f"data[{name!r}]: {p}" for p in check_data(paired.X, paired.y)]
            continue
        try:  # a datasets object data_sets could not read: its problems
            value = as_arrays(value, name=f"data[{name!r}]")
        except InvalidInput as exc:
            problems += exc.problems
            continue
        x, y = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
        if isinstance(value, (tuple, list)) and not (isinstance(value, tuple) and len(value) == 2):
            problems.append(f"data[{name!r}] is a {type(value).__name__} of {len(value)}: pass "
                            "(X, y), or X alone.")
            continue
        try:
            X = as_dask_array(x, name=f"data[{name!r}] X")
            Y = as_dask_array(y if y is not None else np.zeros(X.shape[0], dtype=np.int8))
        except InvalidInput as exc:
            problems += exc.problems
            continue
        problems += [f"data[{name!r}]: {p}" for p in check_data(X, Y)]
    return problems


def pickled(fn: Any) -> bytes:
    """``fn`` pickled by value, as it travels to the ranks.

    Raises
    ------
    InvalidInput
        When it cannot be: what it closes over is named.
    """
    from dask_train.models._transport import dumps_by_value

    try:
        return dumps_by_value(fn)
    except Exception as exc:
        raise InvalidInput([f"the function {getattr(fn, '__name__', fn)!r} cannot be pickled "
                            f"({type(exc).__name__}: {exc}): it travels to the workers; create "
                            "what it closes over (a model, a lock, a file) inside it."]) from None
