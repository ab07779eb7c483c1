"""A training loop's own state (``{"model": ..., "opt": ...}``) as one safetensors file, never a
pickle: the tensors go in the file's body, everything else (the nesting, numbers, strings, a
torch optimizer's integer keys and tuples) as JSON in its header.

``dt.run``'s ``ctx.report(checkpoint=...)`` writes what it is given this way; a restart reads it
back as it was given, tensors on the CPU.

Examples
--------
>>> import tempfile, torch
>>> state = {"model": {"w": torch.ones(2)}, "opt": {"state": {0: {"step": 3}}, "betas": (0.9, 0.99)},
...          "epoch": 4}
>>> path = save_state(state, tempfile.mkdtemp() + "/state.safetensors")
>>> back = load_state(path)
>>> back["opt"]["state"][0]["step"], back["opt"]["betas"], back["model"]["w"].tolist()
(3, (0.9, 0.99), [1.0, 1.0])
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from dask_train.checkpoint._io import PathLike, load_metadata, load_tensors, save_tensors
from dask_train.errors import InvalidInput

#: The header key of the JSON structure.
STATE_KEY = "dask_train.state"


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def flatten_state(state: Any, *, name: str = "checkpoint") -> tuple[dict[str, Any], Any]:
    """Split ``state`` into its tensors (by path) and a JSON-able structure that names them.

    Raises
    ------
    InvalidInput
        Naming every value that is neither a tensor, a numpy array, a number, a string, a bool,
        None, nor a list, tuple or dict of those, with its path.
    """
    tensors: dict[str, Any] = {}
    problems: list[str] = []

    def walk(value: Any, path: str) -> Any:
        if _is_tensor(value) or isinstance(value, np.ndarray):
            key = f"t{len(tensors)}"
            tensors[key] = value
            return {"__tensor__": key, "numpy": isinstance(value, np.ndarray)}
        if isinstance(value, (bool, int, str)) or value is None:
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if isinstance(value, (np.integer, np.floating, np.bool_)):
            return walk(value.item(), path)
        if isinstance(value, (list, tuple)):
            items = [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return items if isinstance(value, list) else {"__tuple__": items}
        if isinstance(value, Mapping):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: walk(v, f"{path}[{k!r}]") for k, v in value.items()}
            # A torch optimizer's state is keyed by parameter index: JSON keys are text.
            return {"__items__": [[walk(k, f"{path} key"), walk(v, f"{path}[{k!r}]")]
                                  for k, v in value.items()]}
        problems.append(f"{path} is a {type(value).__name__}: a checkpoint holds tensors, numpy "
                        "arrays, numbers, strings, None, and lists, tuples and dicts of them "
                        "(store its state_dict(), or convert it).")
        return None

    structure = walk(state, name)
    if problems:
        raise InvalidInput(problems)
    return tensors, structure


def unflatten_state(structure: Any, tensors: Mapping[str, Any]) -> Any:
    """The state :func:`flatten_state` split, rebuilt (tensors as torch tensors on the CPU,
    numpy arrays as numpy)."""
    if isinstance(structure, list):
        return [unflatten_state(v, tensors) for v in structure]
    if not isinstance(structure, dict):
        return structure
    if "__tensor__" in structure:
        tensor = tensors[structure["__tensor__"]]
        return tensor.numpy() if structure.get("numpy") else tensor
    if "__tuple__" in structure:
        return tuple(unflatten_state(v, tensors) for v in structure["__tuple__"])
    if "__items__" in structure:
        return {unflatten_state(k, tensors): unflatten_state(v, tensors)
                for k, v in structure["__items__"]}
    if "__float__" in structure:
        return float(structure["__float__"])
    return {k: unflatten_state(v, tensors) for k, v in structure.items()}


def save_state(state: Any, path: PathLike, *, metadata: Mapping[str, str] | None = None) -> str:
    """Write ``state`` (nested dicts and lists of tensors and plain values) to one safetensors file,
    atomically (see :func:`~dask_train.checkpoint.save_tensors`); ``metadata`` joins the header."""
    tensors, structure = flatten_state(state)
    header = {**(metadata or {}), STATE_KEY: json.dumps(structure)}
    return save_tensors(tensors, path, metadata=header)


def load_state(path: PathLike) -> Any:
    """Read a state written by :func:`save_state` (JSON and tensors, never a pickle)."""
    header = load_metadata(path)
    if STATE_KEY not in header:
        raise InvalidInput([f"{path} holds no training-loop state (no {STATE_KEY!r} header): it "
                            "was not written by ctx.report(checkpoint=...)."])
    return unflatten_state(json.loads(header[STATE_KEY]), load_tensors(path))
