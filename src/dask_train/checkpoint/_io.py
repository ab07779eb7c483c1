"""Atomic safetensors files on a local disk or any fsspec URL; loading never unpickles."""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import struct
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from dask_train.errors import InvalidInput

# torch and safetensors.torch load inside the functions that touch tensors: the controller and
# the report import this package for CheckpointConfig and the store's paths, and a client or
# worker that never writes a tensor must not pay torch's import (about 2 s).
if TYPE_CHECKING:
    import torch

PathLike = str | os.PathLike[str]

# The safetensors format caps its JSON header at 100 MB; a larger length means "not safetensors".
_MAX_HEADER_BYTES = 100_000_000


class StoragePath(str):
    """A checkpoint file's path or URL that carries the fsspec ``storage_options`` to open it
    with (credentials, an endpoint), so the worker that writes or reads a shard there uses the
    checkpoint's options: they travel with the path, inside the role's task, as the options of
    ``da.from_zarr(url, storage_options=...)`` travel inside its graph.

    Examples
    --------
    >>> import pickle
    >>> path = pickle.loads(pickle.dumps(StoragePath("s3://b/shard-0", {"anon": True})))
    >>> path, path.storage_options
    ('s3://b/shard-0', {'anon': True})
    """

    storage_options: dict[str, Any]

    def __new__(cls, path: str, storage_options: Mapping[str, Any]) -> StoragePath:
        obj = super().__new__(cls, path)
        obj.storage_options = dict(storage_options)
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (StoragePath, (str(self), self.storage_options))


def options_of(path: object, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fsspec options to open ``path`` with: those ``given``, else the path's own."""
    if given is not None:
        return dict(given)
    return dict(getattr(path, "storage_options", None) or {})


def _to_tensor(*, name: str, value: object, problems: list[str]) -> torch.Tensor | None:
    import torch

    if isinstance(value, np.ndarray):
        try:
            # Native byte order: torch cannot wrap big-endian arrays.
            value = torch.from_numpy(np.ascontiguousarray(value, value.dtype.newbyteorder("=")))
        except TypeError:
            problems.append(
                f"tensors[{name!r}] is a numpy array of dtype {value.dtype}: use a numeric dtype."
            )
            return None
    if not isinstance(value, torch.Tensor):
        problems.append(
            f"tensors[{name!r}] is a {type(value).__name__}: use a torch.Tensor or numpy.ndarray."
        )
        return None
    if value.layout != torch.strided or value.is_meta:
        kind = "a meta tensor" if value.is_meta else f"a tensor with layout {value.layout}"
        problems.append(
            f"tensors[{name!r}] is {kind}: safetensors stores dense tensors with data; "
            "convert it with .to_dense() or materialise it first."
        )
        return None
    # On the host: a file holds bytes, and a GPU job's checkpoint must load on any machine.
    return value.detach().cpu().contiguous()


def _prepare(*, tensors: Mapping[str, object], problems: list[str]) -> dict[str, torch.Tensor]:
    """Check every entry, then return detached, contiguous tensors that share no storage."""
    prepared: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, value in tensors.items():
        if not isinstance(name, str):
            problems.append(f"tensor name {name!r} is a {type(name).__name__}: use a str.")
            continue
        tensor = _to_tensor(name=name, value=value, problems=problems)
        if tensor is None:
            continue
        # safetensors refuses tensors that share memory (views of one buffer, tied weights). Clone
        # only those, so a large model is not copied whole just to be written.
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen_storage:
            tensor = tensor.clone()
        seen_storage.add(tensor.untyped_storage().data_ptr())
        prepared[name] = tensor
    return prepared


def _check_metadata(*, metadata: Mapping[str, str] | None, problems: list[str]) -> dict[str, str] | None:
    if metadata is None:
        return None
    problems += [
        f"metadata[{key!r}] = {value!r}: safetensors metadata holds text only; use str keys and "
        "values (json.dumps anything structured)."
        for key, value in metadata.items()
        if not isinstance(key, str) or not isinstance(value, str)
    ]
    return dict(metadata)


def _temporary_name(*, path: str) -> str:
    # Same directory as the target, so the final rename never crosses filesystems.
    return f"{path}.tmp-{uuid.uuid4().hex}"


def _fsync_directory(*, directory: str) -> None:
    # Makes the rename itself durable; not every platform can open a directory, hence suppress.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_local_atomic(path: str, write: Callable[[str], object]) -> None:
    """Write a local file by ``write(temporary)``, fsync and rename: old file or new, never half."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    temporary = _temporary_name(path=path)
    try:
        write(temporary)
        # Data on disk before the rename: a crash then leaves the old file or the new, never half.
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise
    _fsync_directory(directory=directory)


def write_remote_atomic(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` on an fsspec filesystem through a temporary object."""
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    temporary = _temporary_name(path=path)
    try:
        with fs.open(temporary, "wb") as handle:
            handle.write(data)
        # Object stores have no atomic rename; mv is copy-then-delete, so readers still never see
        # a partly written object at `path`.
        fs.mv(temporary, path)
    except BaseException:
        with contextlib.suppress(Exception):
            if fs.exists(temporary):
                fs.rm(temporary)
        raise


def _write_local(*, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, path: str) -> None:
    import safetensors.torch

    write_local_atomic(path, lambda tmp: safetensors.torch.save_file(tensors, tmp, metadata=metadata))


def write_bytes_atomic(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` on ``fs`` atomically: renamed into place on a local file
    system (:func:`write_local_atomic`), one upload elsewhere (:func:`write_remote_atomic`)."""
    if isinstance(fs, LocalFileSystem):
        write_local_atomic(path, lambda tmp: Path(tmp).write_bytes(data))
    else:
        write_remote_atomic(fs, path, data)


def _write(*, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, path: PathLike,
           storage_options: Mapping[str, Any] | None = None) -> None:
    """Write prepared tensors to ``path`` atomically: renamed into place on a local file system,
    one upload of the whole file elsewhere (object stores have no rename)."""
    fs, fs_path = url_to_fs(os.fspath(path), **options_of(path, storage_options))
    if isinstance(fs, LocalFileSystem):
        _write_local(tensors=tensors, metadata=metadata, path=fs_path)
    else:
        write_remote_atomic(fs, fs_path, encode(tensors=tensors, metadata=metadata))


def encode(*, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes:
    """Prepared tensors as one safetensors file's bytes: a copy, which the tensors' owner may
    change as soon as this returns (see :func:`write_encoded`)."""
    import safetensors.torch

    return safetensors.torch.save(tensors, metadata=metadata)


def write_encoded(data: bytes, path: PathLike, *,
                  storage_options: Mapping[str, Any] | None = None) -> None:
    """Write a file's bytes (from :func:`encode`) to ``path`` atomically, as :func:`_write`."""
    fs, fs_path = url_to_fs(os.fspath(path), **options_of(path, storage_options))
    write_bytes_atomic(fs, fs_path, data)


def save_tensors(
    tensors: Mapping[str, torch.Tensor | np.ndarray],
    path: PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
) -> str:
    """Write tensors to a safetensors file atomically.

    The file is written under a temporary name next to ``path`` and then renamed, so ``path`` holds
    either its previous content or the complete new file, never a partial one.

    Parameters
    ----------
    tensors : mapping of str to torch.Tensor or numpy.ndarray
        The tensors to store; they are detached and made contiguous, and any that share memory
        with an earlier one are copied.
    path : str or os.PathLike
        A local path or an fsspec URL such as ``"memory://ckpt/model.safetensors"`` or
        ``"s3://bucket/model.safetensors"``. Parent directories are created.
    metadata : mapping of str to str, optional
        Text stored in the file header; read it back with :func:`load_metadata`.

    Returns
    -------
    str
        The final path, as given.

    Raises
    ------
    InvalidInput
        If an entry is not a dense tensor or numeric array, or metadata is not text; all listed.

    Examples
    --------
    >>> import tempfile, torch
    >>> path = save_tensors({"w": torch.ones(2)}, tempfile.mkdtemp() + "/t.safetensors")
    >>> load_tensors(path)["w"]
    tensor([1., 1.])
    """
    problems: list[str] = []
    prepared = _prepare(tensors=tensors, problems=problems)
    checked = _check_metadata(metadata=metadata, problems=problems)
    if problems:
        raise InvalidInput(problems)
    _write(tensors=prepared, metadata=checked, path=path)
    return os.fspath(path)


def load_tensors(path: PathLike) -> dict[str, torch.Tensor]:
    """Read every tensor of a safetensors file, on the CPU.

    Parameters
    ----------
    path : str or os.PathLike
        A local path or an fsspec URL (a ``StoragePath`` opens with its own options).

    Returns
    -------
    dict of str to torch.Tensor
        Tensors by name; reading never unpickles.

    Examples
    --------
    >>> import tempfile, torch
    >>> path = save_tensors({"b": torch.zeros(3)}, tempfile.mkdtemp() + "/t.safetensors")
    >>> sorted(load_tensors(path))
    ['b']
    """
    import safetensors.torch

    fs, fs_path = url_to_fs(os.fspath(path), **options_of(path, None))  # a StoragePath's own
    if isinstance(fs, LocalFileSystem):
        return safetensors.torch.load_file(fs_path)
    return safetensors.torch.load(fs.cat_file(fs_path))


def _read_header(*, fs: AbstractFileSystem, fs_path: str, shown: str) -> dict[str, Any]:
    """Read only the JSON header: an 8-byte little-endian length, then that many bytes of JSON."""
    with fs.open(fs_path, "rb") as handle:
        prefix = handle.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        raw = handle.read(length) if 0 < length <= _MAX_HEADER_BYTES else b""
    try:
        header = json.loads(raw)
    except ValueError:
        header = None
    if not isinstance(header, dict):
        fix = "pass a file written by save_tensors or save_module."
        raise InvalidInput([f"path={shown!r} is not a safetensors file: {fix}"])
    return header


def load_metadata(path: PathLike) -> dict[str, str]:
    """Read the text metadata of a safetensors file without reading its tensors.

    Parameters
    ----------
    path : str or os.PathLike
        A local path or an fsspec URL.

    Returns
    -------
    dict of str to str
        Empty when the file was written without metadata.

    Raises
    ------
    InvalidInput
        If the file is not a safetensors file.

    Examples
    --------
    >>> import tempfile, torch
    >>> path = tempfile.mkdtemp() + "/t.safetensors"
    >>> _ = save_tensors({"w": torch.ones(1)}, path, metadata={"step": "10"})
    >>> load_metadata(path)
    {'step': '10'}
    """
    fs, fs_path = url_to_fs(os.fspath(path), **options_of(path, None))
    header = _read_header(fs=fs, fs_path=fs_path, shown=os.fspath(path))
    metadata = header.get("__metadata__") or {}
    return {str(key): str(value) for key, value in metadata.items()}


def load_shapes(path: PathLike) -> dict[str, list[int]]:
    """Read the name and shape of every tensor of a safetensors file from its header alone (a
    model's weights checked against a model before anything is loaded or sent).

    Parameters
    ----------
    path : str or os.PathLike
        A local path or an fsspec URL.

    Returns
    -------
    dict of str to list of int
        Shapes by tensor name.

    Raises
    ------
    InvalidInput
        If the file is not a safetensors file.

    Examples
    --------
    >>> import tempfile, torch
    >>> path = tempfile.mkdtemp() + "/t.safetensors"
    >>> _ = save_tensors({"w": torch.ones(2, 3)}, path)
    >>> load_shapes(path)
    {'w': [2, 3]}
    """
    fs, fs_path = url_to_fs(os.fspath(path), **options_of(path, None))
    header = _read_header(fs=fs, fs_path=fs_path, shown=os.fspath(path))
    return {str(name): [int(n) for n in entry.get("shape", [])] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict)}
