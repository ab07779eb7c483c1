"""A scheduler whose environment cannot import dask-train, or imports another version, is named
with the fix before anything is submitted: by ``dt.connect`` and by the first fit on a client the
user made. Real ``dask scheduler`` processes from another Python environment, real workers.

The scheduler's environment is a venv made in the test (``--without-pip``: 0.05 s) whose only
package directory is this environment's site-packages, read as a plain path: dask and distributed
import from there, and dask-train does not, because its editable install is a ``.pth`` file that
Python reads only in a site directory. That directory still holds dask-train's metadata, so Dask's
``get_versions`` reports dask-train 0.1.0 on that scheduler: only a real import tells. The other
version is that same environment with a ``dask_train`` package of ``__version__ = "0.0.9"`` first
on its ``PYTHONPATH``: no plugin and no change to the scheduler's code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt

sys.path.insert(0, str(Path(__file__).parents[1] / "controller"))
from _dask_cli import EXIT_S, scheduler_address  # noqa: E402


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python environment with dask and distributed but not dask-train."""
    where = tmp_path_factory.mktemp("scheduler-env")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where / "venv")],
                   check=True, timeout=60)
    site = next((where / "venv" / "lib").glob("python*/site-packages"))
    (site / "dask_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = where / "venv" / "bin" / "python"
    found = subprocess.run([str(python), "-c", "import distributed, dask_train"],
                           capture_output=True, text=True, timeout=60, env=_env())
    assert "No module named 'dask_train'" in found.stderr, found.stderr
    return python


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, **extra}


@contextmanager
def _cluster(python: Path, tmp_path: Path, **env: str) -> Iterator[str]:
    """A ``dask scheduler`` run by ``python`` and one ``dask worker`` of this environment."""
    info, log = tmp_path / "scheduler.json", tmp_path / "scheduler.log"
    with log.open("w") as out:
        scheduler = subprocess.Popen(
            [str(python), "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
             "--port", "0", "--no-dashboard", "--scheduler-file", str(info)],
            stdout=out, stderr=out, env=_env(**env))
    worker = None
    try:
        address = scheduler_address(info)
        # This environment's worker, with the test's own path to dask-train (if any).
        worker = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
             "--no-nanny", "--no-dashboard", "--host", "127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with Client(address, timeout=30) as client:
            client.wait_for_workers(1, timeout=30)
        yield address
    finally:
        for process in (worker, scheduler):
            if process is not None:
                process.terminate()
                process.wait(EXIT_S)


def test_connect_names_a_scheduler_that_cannot_import_dask_train(
        bare_python: Path, tmp_path: Path) -> None:
    with _cluster(bare_python, tmp_path) as address:
        with pytest.raises(dt.ClusterMismatch) as raised:
            dt.connect(address, quiet=True)
    problems = raised.value.problems
    assert len(problems) == 1, problems  # the workers are the client's: only the scheduler
    assert problems[0].startswith(
        "scheduler cannot import dask_train (ModuleNotFoundError: No module named 'dask_train'; "
        f"the client has {dt.__version__}): the scheduler unpickles every task graph")
    assert f"install dask-train {dt.__version__} in the scheduler's environment" in problems[0]


def test_the_first_fit_on_a_users_client_names_the_scheduler_before_submitting(
        bare_python: Path, tmp_path: Path) -> None:
    X = da.from_array(np.random.default_rng(0).normal(size=(256, 4)).astype("float32"), 64)
    y = (X[:, 0] > 0).astype("int64")
    with _cluster(bare_python, tmp_path) as address, Client(address) as client:
        trainer = dt.Trainer(torch.nn.Linear(4, 2), loss="cross_entropy", workers=1, epochs=1,
                             progress=False, client=client)
        with pytest.raises(dt.ClusterMismatch) as raised:
            trainer.fit(X, y)
        with pytest.raises(dt.ClusterMismatch):
            dt.run(lambda ctx: None, client=client)
        held = client.who_has()
    assert raised.value.problems[0].startswith("scheduler cannot import dask_train")
    assert not held  # nothing was submitted: no key anywhere
    log = (tmp_path / "scheduler.log").read_text()
    assert "deserializ" not in log and "Traceback" not in log, log[-3000:]


def test_a_scheduler_with_another_dask_train_version_is_named(
        bare_python: Path, tmp_path: Path) -> None:
    other = tmp_path / "other" / "dask_train"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text('__version__ = "0.0.9"\n')
    with _cluster(bare_python, tmp_path, PYTHONPATH=str(other.parent)) as address:
        with pytest.raises(dt.ClusterMismatch) as raised:
            dt.connect(address, quiet=True)
    assert raised.value.problems == [raised.value.problems[0]]
    assert raised.value.problems[0].startswith(
        f"scheduler runs dask_train 0.0.9, the client {dt.__version__}: the scheduler unpickles")
