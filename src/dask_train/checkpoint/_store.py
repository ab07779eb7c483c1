"""Checkpoint settings and the directory layout of a run's checkpoints, on a local disk or any fsspec URL.

One checkpoint is one directory ``<path>/ckpt-<step:012d>-<generation:03d>/`` holding the parameter
servers' ``shard-<i>.safetensors`` files and a ``manifest.json`` written last. A checkpoint is
*complete* when its manifest parses and names only files that exist, so a kill at any moment leaves
the previous complete checkpoint as the newest one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import posixpath
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs

from dask_train.checkpoint._io import StoragePath, write_bytes_atomic
from dask_train.checkpoint._sharded import sharded_complete
from dask_train.errors import InvalidInput

MANIFEST = "manifest.json"
FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d+)-(\d+)$")


def _is_int(value: object) -> bool:
    # bool is an int subclass, but keep=True is a mistake, not "keep one".
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _path_problems(name: str, path: str | os.PathLike[str]) -> list[str]:
    """A local path (or ``file://`` URL) that exists as a file, or under a file, cannot hold
    checkpoint directories: found now, not at the first write after training (when the model
    would be lost). Other URLs are checked by their first write."""
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        return []
    local = Path(text.removeprefix("file://")).expanduser()
    for part in (local, *local.parents):
        if part.exists():
            if part.is_dir():
                return []
            what = "is a file" if part == local else f"lies under the file {str(part)!r}"
            return [f"{name}(path={text!r}): the path {what}, and checkpoints are directories "
                    "under it: use a directory (existing or not)."]
    return []


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often a training job writes checkpoints.

    Parameters
    ----------
    path : str or os.PathLike
        A local directory or an fsspec URL (``"memory://run1"``, ``"s3://bucket/run1"``,
        ``"file:///data/run1"``). Each checkpoint is a sub-directory of it.
    every_seconds : float or None
        Write a checkpoint when this many seconds have passed since the last one.
    every_steps : int or None
        Write a checkpoint when this many optimizer steps have been taken since the last one. With
        both triggers None, only the final checkpoint, when the job stops, is written.
    keep : int
        How many of the newest complete checkpoints to keep; older ones are deleted.
    storage_options : mapping, optional
        Passed to fsspec, e.g. credentials for an object store: by the client for the manifests,
        and by the workers for the shard files they write and read (the options travel with the
        shard paths, inside the roles' tasks).

    Raises
    ------
    InvalidInput
        Listing every invalid field, each with its value and the fix.

    Examples
    --------
    >>> config = CheckpointConfig("ckpt/", every_seconds=None, every_steps=100, keep=2)
    >>> config.due(now=0.0, last_time=0.0, step=250, last_step=100)
    True
    """

    path: str | os.PathLike[str]
    every_seconds: float | None = 30.0
    every_steps: int | None = None
    keep: int = 3
    storage_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        name = type(self).__name__
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            problems.append(
                f"{name}(path={self.path!r}): path must be a non-empty str or os.PathLike "
                "(a local directory or an fsspec URL such as 's3://bucket/run1')."
            )
        seconds = self.every_seconds
        if seconds is not None and not (_is_number(seconds) and math.isfinite(seconds) and seconds > 0):
            problems.append(
                f"{name}(every_seconds={seconds!r}): every_seconds must be a finite number > 0, "
                "or None to not checkpoint on time."
            )
        steps = self.every_steps
        if steps is not None and not (_is_int(steps) and steps >= 1):
            problems.append(
                f"{name}(every_steps={steps!r}): every_steps must be an integer >= 1, "
                "or None to not checkpoint on steps."
            )
        if not (_is_int(self.keep) and self.keep >= 1):
            problems.append(
                f"{name}(keep={self.keep!r}): keep must be an integer >= 1 "
                "(how many newest checkpoints to keep)."
            )
        options = self.storage_options
        if options is not None and not (
            isinstance(options, Mapping) and all(isinstance(k, str) for k in options)
        ):
            problems.append(
                f"{name}(storage_options={options!r}): storage_options must be a mapping with str "
                "keys (fsspec keyword arguments), or None."
            )
        if not problems:
            problems += _path_problems(name, self.path)
        if problems:
            raise InvalidInput(problems)

    @classmethod
    def of(cls, value: Any) -> CheckpointConfig | None:
        """``checkpoint=`` as a config: a config as it is, a path or URL as
        ``CheckpointConfig(path)`` (every 30 s, keep 3), None as None.

        Raises
        ------
        InvalidInput
            For anything else, or a path that cannot hold checkpoints.

        Examples
        --------
        >>> CheckpointConfig.of("runs/x") == CheckpointConfig("runs/x")
        True
        """
        if value is None or isinstance(value, CheckpointConfig):
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls(value)
        raise InvalidInput([f"checkpoint={value!r} is invalid: pass a directory or fsspec URL "
                            "('runs/x'), dt.CheckpointConfig(path, every_seconds=30, keep=3), "
                            "or None."])

    def due(self, *, now: float, last_time: float, step: int, last_step: int) -> bool:
        """Whether a checkpoint is due: either trigger fired and a step was taken since the last one.

        Parameters
        ----------
        now, last_time : float
            The current time and the time of the last checkpoint (or of the job's start), in seconds
            on one clock.
        step, last_step : int
            The current optimizer step and the step of the last checkpoint (or the first step).

        Returns
        -------
        bool
            Never True when ``step <= last_step``: a checkpoint of an unchanged model would only
            overwrite the same directory.

        Examples
        --------
        >>> CheckpointConfig("ckpt/", every_seconds=30).due(now=31, last_time=0, step=5, last_step=0)
        True
        """
        if step <= last_step:
            return False
        by_time = self.every_seconds is not None and now - last_time >= self.every_seconds
        by_steps = self.every_steps is not None and step - last_step >= self.every_steps
        return by_time or by_steps


def shard_name(index: int) -> str:
    """File name of shard ``index`` inside a checkpoint directory.

    Examples
    --------
    >>> shard_name(2)
    'shard-2.safetensors'
    """
    return f"shard-{index}.safetensors"


class CheckpointStore:
    """The checkpoints of one run under ``config.path``: layout, manifests, discovery and pruning.

    Shard files are written by the parameter servers (see :func:`save_shard`), in parallel and each
    atomically; the controller writes the manifest with :meth:`write_manifest` once they all
    succeeded. Only JSON and safetensors are ever read back, never a pickle.

    Parameters
    ----------
    config : CheckpointConfig

    Examples
    --------
    >>> import tempfile
    >>> store = CheckpointStore(CheckpointConfig(tempfile.mkdtemp()))
    >>> directory = store.directory(100, 0)
    >>> path = store.write_manifest(directory, {"shards": [], "step": 100})
    >>> store.newest()[1]["step"]
    100
    """

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.path = os.fspath(config.path)
        # A URL keeps its protocol in the paths handed out, so that a parameter server on another
        # machine can open them; a local path is made absolute, since workers may run elsewhere.
        self._url = "://" in self.path or "::" in self.path
        if not self._url:
            self.path = os.path.abspath(self.path)
        options = dict(config.storage_options or {})
        fs, root = url_to_fs(self.path, **options)
        self.fs: AbstractFileSystem = fs
        self._root = root.rstrip("/") or root

    # -- layout ----------------------------------------------------------------------------------
    def _join(self, base: str, name: str) -> str:
        if self._url:
            return f"{base.rstrip('/')}/{name}"
        return os.path.join(base, name)

    def _fs_path(self, directory: str) -> str:
        """The filesystem path of a directory handed out by this store (its name under the root)."""
        name = posixpath.basename(os.fspath(directory).rstrip("/").replace(os.sep, "/"))
        return f"{self._root}/{name}"

    def directory(self, step: int, generation: int) -> str:
        """The directory of the checkpoint taken at ``step`` in ``generation`` (not created).

        Examples
        --------
        >>> CheckpointStore(CheckpointConfig("memory://run")).directory(42, 1)
        'memory://run/ckpt-000000000042-001'
        """
        if not (_is_int(step) and step >= 0 and _is_int(generation) and generation >= 0):
            raise InvalidInput(
                [f"directory(step={step!r}, generation={generation!r}): use integers >= 0."]
            )
        return self._join(self.path, f"ckpt-{step:012d}-{generation:03d}")

    def shard_path(self, directory: str, index: int) -> str:
        """Path of shard ``index`` in ``directory``, for :func:`save_shard` on the server's worker
        (a :class:`StoragePath` carrying the config's ``storage_options``, when it has any)."""
        path = self._join(directory, shard_name(index))
        options = self.config.storage_options
        return StoragePath(path, options) if options else path

    # -- manifest --------------------------------------------------------------------------------
    def write_manifest(self, directory: str, manifest: Mapping[str, Any]) -> str:
        """Write ``manifest.json`` atomically, which makes the checkpoint complete.

        Parameters
        ----------
        directory : str
            From :meth:`directory`.
        manifest : mapping
            JSON-serialisable. ``manifest["shards"]`` lists the shard file names (or paths inside
            ``directory``) that must all exist; ``"format"``, ``"written_at"`` (Unix time), and, when
            absent, ``"step"`` and ``"generation"`` are added.

        Returns
        -------
        str
            The manifest's path.

        Raises
        ------
        InvalidInput
            If ``shards`` is not a list of names in ``directory``, a listed shard does not exist
            (write every shard before the manifest), or the manifest is not JSON-serialisable.
        """
        fs_dir = self._fs_path(directory)
        record = dict(manifest)
        record["shards"] = self._shard_names(directory, record.get("shards"))
        missing = [n for n in record["shards"] if not self.fs.exists(f"{fs_dir}/{n}")]
        if missing:
            raise InvalidInput(
                [f"write_manifest({directory!r}): shard files {missing} do not exist; write every "
                 "shard before the manifest, which marks the checkpoint complete."]
            )
        match = _NAME.match(posixpath.basename(fs_dir))
        if match:
            record.setdefault("step", int(match.group(1)))
            record.setdefault("generation", int(match.group(2)))
        record["format"] = FORMAT
        record["written_at"] = time.time()
        try:
            data = json.dumps(record, indent=1).encode()
        except (TypeError, ValueError) as exc:
            raise InvalidInput(
                [f"write_manifest({directory!r}): the manifest is not JSON-serialisable ({exc}); "
                 "store tensors in shard files and only plain values in the manifest."]
            ) from exc
        self._write_atomic(path=f"{fs_dir}/{MANIFEST}", data=data)
        return self._join(directory, MANIFEST)

    def _shard_names(self, directory: str, shards: object) -> list[str]:
        if not isinstance(shards, list) or not all(isinstance(s, str) for s in shards):
            raise InvalidInput(
                [f"write_manifest({directory!r}): manifest['shards'] = {shards!r}; use a list of the "
                 "shard file names written into the directory (an empty list when there are none)."]
            )
        prefix = self._join(directory, "")
        names = [s[len(prefix):] if s.startswith(prefix) else s for s in shards]
        bad = [s for s, n in zip(shards, names) if not n or "/" in n or os.sep in n or n == MANIFEST]
        if bad:
            raise InvalidInput(
                [f"write_manifest({directory!r}): shards {bad} are not files inside that directory; "
                 "use names such as 'shard-0.safetensors' or paths from shard_path()."]
            )
        return names

    def _write_atomic(self, *, path: str, data: bytes) -> None:
        # A crash leaves no manifest or the whole one, never a partly written manifest.json.
        write_bytes_atomic(self.fs, path, data)

    def read_manifest(self, directory: str) -> dict[str, Any]:
        """Parse ``manifest.json`` of ``directory`` (JSON only, never a pickle).

        Raises
        ------
        InvalidInput
            If it is missing, is not a JSON object or has an unknown format.
        """
        path = f"{self._fs_path(directory)}/{MANIFEST}"
        manifest = self._parse(path)
        if manifest is None:
            raise InvalidInput(
                [f"{self._join(directory, MANIFEST)!r} is missing or is not a format-{FORMAT} "
                 "checkpoint manifest: the checkpoint was not completed; use newest() to find the "
                 "last complete one."]
            )
        return manifest

    def _parse(self, path: str) -> dict[str, Any] | None:
        try:
            manifest = json.loads(self.fs.cat_file(path))
        except (OSError, ValueError):  # missing, unreadable, truncated or not UTF-8
            return None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            return None
        return manifest

    # -- discovery -------------------------------------------------------------------------------
    def _candidates(self) -> list[tuple[tuple[int, int], str]]:
        """Every checkpoint directory, complete or not, as ((step, generation), fs path), oldest first."""
        try:
            listed = self.fs.ls(self._root, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = []
        for entry in listed:
            match = _NAME.match(posixpath.basename(str(entry).rstrip("/")))
            if match:
                found.append(((int(match.group(1)), int(match.group(2))), f"{self._root}/{match.group(0)}"))
        return sorted(found)

    def _complete_manifest(self, fs_dir: str) -> dict[str, Any] | None:
        manifest = self._parse(f"{fs_dir}/{MANIFEST}")
        if manifest is None:
            return None
        shards = manifest.get("shards")
        if not isinstance(shards, list) or not all(isinstance(s, str) and "/" not in s for s in shards):
            return None
        if not all(self.fs.exists(f"{fs_dir}/{s}") for s in shards):
            return None
        sharded = manifest.get("sharded")
        if sharded is not None and not sharded_complete(self.fs, fs_dir, sharded):
            return None  # a sharded state not (or not yet) whole: a copy cut short, say
        return manifest

    def _shown(self, fs_dir: str) -> str:
        return self._join(self.path, posixpath.basename(fs_dir))

    def complete(self) -> list[str]:
        """Directories of the complete checkpoints, oldest to newest by (step, generation)."""
        return [self._shown(d) for _, d in self._candidates() if self._complete_manifest(d) is not None]

    def newest(self) -> tuple[str, dict[str, Any]] | None:
        """The newest complete checkpoint as (directory, manifest), or None when there is none."""
        for _, fs_dir in reversed(self._candidates()):
            manifest = self._complete_manifest(fs_dir)
            if manifest is not None:
                return self._shown(fs_dir), manifest
        return None

    def prune(self) -> list[str]:
        """Delete all but the newest ``keep`` complete checkpoints, and older incomplete ones.

        An incomplete directory older than the newest complete checkpoint is the leftover of a kill
        mid-write and is deleted; one newer than it may be being written now and is kept.

        Returns
        -------
        list of str
            The deleted directories.
        """
        candidates = self._candidates()
        complete = [(key, d) for key, d in candidates if self._complete_manifest(d) is not None]
        if not complete:
            return []
        newest_key = complete[-1][0]
        kept = {d for _, d in complete[-self.config.keep:]}
        done = {d for _, d in complete}
        doomed = [
            d for key, d in candidates
            if (d in done and d not in kept) or (d not in done and key < newest_key)
        ]
        deleted = []
        for fs_dir in doomed:
            # Another process may prune at the same time (a restarted controller): gone is fine.
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(fs_dir, recursive=True)
            deleted.append(self._shown(fs_dir))
        return deleted
