"""A model's whole output kept over a validation set, for metric functions that pick from it.

A metric function gets what the model returned -- a tensor, a dict, a tuple, a Hugging Face
``ModelOutput`` -- over every validation row at once, as one output of the same type. So each
batch's output is brought to the host (:func:`to_host`) and the batches are joined field by
field (:func:`join`): a tensor with one row per sample is concatenated; anything else (an RNN's
final state, whose first axis is its layers; a scalar) is given as the list of the batches' values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def to_host(out: Any) -> Any:
    """``out`` with every tensor detached on the CPU, floating ones as float32 (an autocast
    output is float16 or bfloat16); the same containers and types."""
    return _rebuild(out, lambda t: t.detach().to("cpu", torch.float32) if t.is_floating_point()
                    else t.detach().cpu())


def _rebuild(out: Any, fn: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, Mapping):
        return _same_type(out, {k: _rebuild(v, fn) for k, v in out.items()})
    if isinstance(out, (tuple, list)):
        items = [_rebuild(v, fn) for v in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    return out


def _same_type(like: Mapping[str, Any], fields: dict[str, Any]) -> Any:
    """A mapping of ``like``'s type (a ``ModelOutput`` stays one), else a dict."""
    if type(like) is dict:
        return fields
    try:
        return type(like)(**fields)
    except TypeError:
        return fields


def join(parts: Sequence[Any], rows: Sequence[int]) -> Any:
    """The outputs of consecutive batches (``rows[i]`` samples in ``parts[i]``) as one output."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        per_row = all(isinstance(p, torch.Tensor) and p.ndim > 0 and p.shape[0] == n
                      and p.shape[1:] == first.shape[1:] for p, n in zip(parts, rows))
        return torch.cat(list(parts)) if per_row else list(parts)
    if isinstance(first, Mapping):
        return _same_type(first, {k: join([p[k] for p in parts], rows) for k in first})
    if isinstance(first, (tuple, list)):
        items = [join([p[i] for p in parts], rows) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    return first if all(p is None for p in parts) else list(parts)


def describe(value: Any) -> str:
    """A short account of an output or target for messages: shapes by field.

    Examples
    --------
    >>> describe({"logits": torch.zeros(2, 4), "hidden": (torch.zeros(1, 2, 8),)})
    "dict {'logits': (2, 4), 'hidden': tuple [(1, 2, 8)]}"
    """
    if isinstance(value, torch.Tensor):
        return str(tuple(value.shape))
    if isinstance(value, Mapping):
        fields = ", ".join(f"{k!r}: {describe(v)}" for k, v in value.items())
        return f"{type(value).__name__} {{{fields}}}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} [{', '.join(describe(v) for v in value)}]"
    return type(value).__name__
