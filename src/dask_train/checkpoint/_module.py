"""Whole torch modules as safetensors checkpoints: the ``state_dict`` through :mod:`._io`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeVar

from dask_train.checkpoint._io import PathLike, load_tensors, save_tensors

if TYPE_CHECKING:  # only the type hints need torch; the module arguments bring it loaded
    import torch

# A string bound: evaluated by type checkers only, so importing this module does not import torch.
ModuleT = TypeVar("ModuleT", bound="torch.nn.Module")


def save_module(module: torch.nn.Module, path: PathLike, *, metadata: Mapping[str, str] | None = None) -> str:
    """Write a module's ``state_dict`` (parameters and buffers) to a safetensors file atomically.

    Parameters that are views of one buffer (as ``torch.nn.utils.vector_to_parameters`` makes)
    or tied weights are copied as needed, so every module can be saved.

    Parameters
    ----------
    module : torch.nn.Module
        The module to save.
    path : str or os.PathLike
        A local path or an fsspec URL.
    metadata : mapping of str to str, optional
        Text stored in the file header.

    Returns
    -------
    str
        The final path, as given.

    Examples
    --------
    >>> import tempfile, torch
    >>> path = save_module(torch.nn.Linear(2, 1), tempfile.mkdtemp() + "/m.safetensors")
    >>> sorted(load_tensors(path))
    ['bias', 'weight']
    """
    return save_tensors(module.state_dict(), path, metadata=metadata)


def load_module(module: ModuleT, path: PathLike) -> ModuleT:
    """Load a file written by :func:`save_module` into ``module`` (strict: every key must match).

    Parameters
    ----------
    module : torch.nn.Module
        A module of the same architecture; its tensors are overwritten in place.
    path : str or os.PathLike
        A local path or an fsspec URL.

    Returns
    -------
    torch.nn.Module
        ``module`` itself.

    Examples
    --------
    >>> import tempfile, torch
    >>> path = save_module(torch.nn.Linear(2, 1), tempfile.mkdtemp() + "/m.safetensors")
    >>> load_module(torch.nn.Linear(2, 1), path)
    Linear(in_features=2, out_features=1, bias=True)
    """
    module.load_state_dict(load_tensors(path), strict=True)
    return module
