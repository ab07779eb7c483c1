"""The command line run as a module (``python -m``), as where no ``dask-train`` script is on the
PATH: the same help, and no warning from Python's module runner."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["dask_train.cli", "dask_train.cli.main"])
def test_the_command_line_runs_as_a_module_without_a_warning(module: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: dask-train"), proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr
