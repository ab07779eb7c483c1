"""A sharded state (``dt.run``'s ``ctx.report(sharded=True)``) in a checkpoint: each rank's part
in ``torch.distributed.checkpoint`` (DCP) files, staged by the ranks, then taken into the
checkpoint's directory by the controller before it writes the manifest.

The manifest is the commit point. On a local disk the staged directory is renamed into the
checkpoint (atomic). An object store has no rename: the files are copied (the data first, DCP's
``.metadata`` last) and the staged ones deleted, so a reader could meet a checkpoint directory
whose copy is not done -- or a copy of a checkpoint synced file by file in any order. So the
manifest, written last, lists every file of the sharded state with its size, and a checkpoint
counts as complete only when each of them is there with that size (:func:`sharded_complete`).

Examples
--------
>>> import os, tempfile
>>> root = tempfile.mkdtemp()
>>> os.makedirs(f"{root}/staged")
>>> for name in ("__0_0.distcp", ".metadata"):
...     with open(f"{root}/staged/{name}", "wb") as f:
...         _ = f.write(b"x" * 3)
>>> files = adopt_sharded(f"{root}/staged", f"{root}/ckpt-1/sharded-r1", {})
>>> files
{'.metadata': 3, '__0_0.distcp': 3}
>>> from fsspec.implementations.local import LocalFileSystem
>>> sharded_complete(LocalFileSystem(), f"{root}/ckpt-1", {"dir": "sharded-r1", "files": files})
True
"""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Mapping
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

#: What torch.distributed.checkpoint writes last, once every rank's part is written.
SHARDED_METADATA = ".metadata"


def _listing(fs: AbstractFileSystem, path: str) -> dict[str, int]:
    """Every file under ``path`` (its name relative to ``path``) and its size, in one listing."""
    base = path.rstrip("/")
    found = fs.find(base, detail=True)
    return {posixpath.relpath(name, base): int(info.get("size") or 0)
            for name, info in found.items() if info.get("type", "file") != "directory"}


def adopt_sharded(staged: str, target: str, options: Mapping[str, Any]) -> dict[str, int]:
    """Move the ranks' staged DCP directory ``staged`` to ``target`` (inside a checkpoint not
    yet complete); the files moved and their sizes, for the manifest.

    A rename on a local disk. On an object store a copy, each file once, DCP's ``.metadata``
    last, then the staged files are deleted (a kill in between leaves the checkpoint without
    its manifest, so incomplete, and the staged files for the job's end to drop).
    """
    fs, source = url_to_fs(staged, **dict(options))
    _, path = url_to_fs(target, **dict(options))
    files = _listing(fs, source)
    if SHARDED_METADATA not in files:
        raise FileNotFoundError(f"{staged} holds no {SHARDED_METADATA}: the ranks' "
                                "torch.distributed.checkpoint save did not finish")
    fs.makedirs(posixpath.dirname(path.rstrip("/")), exist_ok=True)
    if isinstance(fs, LocalFileSystem):
        fs.mv(source, path, recursive=True)
        return files
    for name in sorted(files, key=lambda n: n == SHARDED_METADATA):  # .metadata last
        fs.copy(f"{source.rstrip('/')}/{name}", f"{path.rstrip('/')}/{name}")
    with contextlib.suppress(FileNotFoundError):
        fs.rm(source, recursive=True)
    return files


def sharded_complete(fs: AbstractFileSystem, directory: str, record: Any) -> bool:
    """Whether the sharded state a manifest's ``record`` names is whole in ``directory``: every
    file the manifest lists, with its size (a manifest written before the list was kept: DCP's
    ``.metadata``)."""
    if not isinstance(record, dict) or not isinstance(record.get("dir"), str):
        return False
    path = f"{directory.rstrip('/')}/{record['dir']}"
    listed = record.get("files")
    if not isinstance(listed, dict):
        return bool(fs.exists(f"{path}/{SHARDED_METADATA}"))
    try:
        there = _listing(fs, path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return SHARDED_METADATA in listed and all(there.get(name) == size
                                              for name, size in listed.items())


def save_sharded(state: Any, path: str, options: Mapping[str, Any]) -> None:
    """This rank's part of ``state`` into ``path`` with ``torch.distributed.checkpoint`` (a
    collective: every rank calls it), opened with the checkpoint's ``options``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=_storage(path, options, write=True))


def load_sharded(state: Any, path: str, options: Mapping[str, Any]) -> None:
    """Load the DCP checkpoint at ``path`` into ``state`` in place (split anew for this number
    of ranks), opened with the checkpoint's ``options``."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=_storage(path, options, write=False))


def _storage(path: str, options: Mapping[str, Any], *, write: bool) -> Any:
    """DCP's storage writer (or reader) for ``path``: the local file system's, or fsspec's for
    a URL, opened with ``options``: DCP's own choice from a bare ``checkpoint_id`` opens an
    object store without them (no credentials, the default endpoint)."""
    import torch.distributed.checkpoint as dcp

    if "://" not in str(path):
        return dcp.FileSystemWriter(str(path)) if write else dcp.FileSystemReader(str(path))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    kind = FsspecWriter if write else FsspecReader
    return kind(str(path), **dict(options))
