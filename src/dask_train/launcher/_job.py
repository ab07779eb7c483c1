"""``dt.launch``'s arguments as one record, checked before anything reaches the cluster, and
the program they name, made ready to travel (:class:`~dask_train.launcher._rank.Program`)."""

from __future__ import annotations

import io
import os
import re
import time
import uuid
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dask_train.launcher._rank import Program
from dask_train.policy._settings import ClusterSettings, is_int

#: The most a program's directory may weigh in the archive that travels to the workers.
BUNDLE_BYTES = 32 << 20
#: Directories never shipped with the program: caches, environments, version control.
_SKIPPED_DIRS = {"__pycache__", "node_modules", "site-packages", ".git", ".venv", "venv"}
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def parse_workers(text: str) -> int | tuple[int, int]:
    """``--workers N`` or ``MIN:MAX`` as ``dt.launch`` takes it (checked there).

    Examples
    --------
    >>> parse_workers("2"), parse_workers("1:4")
    (2, (1, 4))
    """
    least, sep, most = text.partition(":")
    try:
        return (int(least), int(most)) if sep else int(least)
    except ValueError:
        raise ValueError(f"--workers {text!r}: give a number of ranks, 2, or MIN:MAX, "
                         "1:4") from None


@dataclass(frozen=True)
class LaunchJob:
    """What one ``dt.launch`` runs and how (see :func:`dask_train.launch`)."""

    target: str
    args: tuple[str, ...]
    module: bool
    cluster: ClusterSettings
    max_restarts: Any
    grace: Any
    include: tuple[str, ...]
    ship: bool
    log_dir: Path
    run_id: str

    @classmethod
    def of(cls, target: Any, args: Sequence[Any], *, module: bool, workers: Any,
           max_restarts: Any, timeout: Any, grace: Any, include: Sequence[str],
           ship: bool, log_dir: Any, run_id: Any, resources: Any = None) -> LaunchJob:
        run_id = str(run_id) if run_id else uuid.uuid4().hex[:12]
        if log_dir is None:
            log_dir = Path("runs") / f"launch-{time.strftime('%Y%m%d-%H%M%S')}-{run_id[:6]}"
        return cls(target=str(target), args=tuple(str(a) for a in args), module=bool(module),
                   cluster=ClusterSettings(workers=workers, timeout=timeout,
                                           resources=resources),
                   max_restarts=max_restarts, grace=grace, include=tuple(include),
                   ship=bool(ship), log_dir=Path(log_dir), run_id=run_id)

    def problems(self) -> list[str]:
        """Every problem with the arguments (nothing is sent anywhere)."""
        problems = self.cluster.problems(ranges=True)
        if self.module:
            if not _MODULE.match(self.target):
                problems.append(f"module={self.target!r} is not a module name: give it as to "
                                "python -m, pkg.train.")
        elif not Path(self.target).is_file():
            problems.append(f"script={self.target!r} is not a file (looked from {os.getcwd()}): "
                            "give the path of the program to run, as to python.")
        if not (is_int(self.max_restarts) and self.max_restarts >= 0):
            problems.append(f"max_restarts={self.max_restarts!r} is invalid: pass an integer "
                            ">= 0, the restarts of the whole gang a failure may cause.")
        if isinstance(self.grace, bool) or not isinstance(self.grace, (int, float)) or \
                not self.grace >= 0:
            problems.append(f"grace={self.grace!r} is invalid: pass the seconds (>= 0) a "
                            "program has between SIGTERM and SIGKILL.")
        for path in self.include:
            if not (self.base / path).exists():
                problems.append(f"include={path!r}: {self.base / path} does not exist; name "
                                f"files or directories under {self.base}.")
        if self.log_dir.exists() and not self.log_dir.is_dir():
            problems.append(f"log_dir={str(self.log_dir)!r} is a file: name a directory.")
        return problems

    @property
    def base(self) -> Path:
        """The program's directory: the script's, or the working directory with ``-m``."""
        return Path.cwd() if self.module else Path(self.target).resolve().parent

    def program(self) -> Program:
        """The program for every rank: run in place (the workers see this machine's paths), or
        with its directory packed to travel (``ship``)."""
        if not self.ship:
            target = self.target if self.module else str(Path(self.target).resolve())
            return Program(target=target, args=self.args, module=self.module, cwd=os.getcwd())
        target = self.target if self.module else Path(self.target).resolve().name
        return Program(target=target, args=self.args, module=self.module,
                       bundle=bundle(self.base, self.include))


def bundle(base: Path, include: Sequence[str] = ()) -> bytes:
    """A zip of ``base``'s ``.py`` files (its subdirectories too, less caches and
    environments) and of what ``include`` names under it, as it travels to the workers.

    Raises
    ------
    ValueError
        Over :data:`BUNDLE_BYTES`: name large data by a path every worker reads instead.
    """
    files: dict[str, Path] = {}
    for root, dirs, names in os.walk(base):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith(".")]
        for name in names:
            if name.endswith(".py"):
                path = Path(root) / name
                files[str(path.relative_to(base))] = path
    for extra in include:
        path = base / extra
        for item in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
            files[str(item.resolve().relative_to(base.resolve()))] = item
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, path in sorted(files.items()):
            archive.write(path, name)
            if out.tell() > BUNDLE_BYTES:
                raise ValueError(
                    f"the program's directory {base} is over {BUNDLE_BYTES >> 20} MiB packed "
                    f"(at {name}): ship code, not data; read data from a path every worker "
                    "reaches (shared storage, an object store).")
    return out.getvalue()
