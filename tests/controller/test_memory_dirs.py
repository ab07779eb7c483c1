"""A job's state in this machine's memory (its copies, its hand-over scratch) outlives a client
killed before it could drop it only until the next job makes such a directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dask_train.controller.cluster._memory import memory_dir, sweep_memory_dirs


def _dead_pid() -> int:
    """The process id of a process that has ended."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_the_directories_of_processes_that_are_gone_are_swept(tmp_path: Path) -> None:
    dead = _dead_pid()
    gone = tmp_path / f"dask-train-copies-job-1-p{dead}-abc_12de"
    (gone / "step-16").mkdir(parents=True)
    (gone / "step-16" / "manifest.json").write_text("{}")
    handed = tmp_path / f"dask-train-hand-over-job-2-p{dead}-x1y2z3w4"
    handed.mkdir()
    mine = tmp_path / f"dask-train-copies-job-3-p{os.getpid()}-q9r8s7t6"
    mine.mkdir()
    other = tmp_path / f"someone-else-p{dead}-abcdefgh"  # not ours, whatever its name says
    other.mkdir()
    assert sweep_memory_dirs(str(tmp_path)) == 2
    assert not gone.exists() and not handed.exists()
    assert mine.exists() and other.exists()


def test_a_new_directory_names_its_process_and_sweeps_the_dead_ones() -> None:
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None
    made = memory_dir("dask-train-copies-test-job-")
    try:
        assert os.path.basename(made).startswith(f"dask-train-copies-test-job-p{os.getpid()}-")
        if where is not None:
            assert os.path.dirname(made) == where
        # A client killed with its job's copies up: the next directory made removes them.
        left = os.path.join(os.path.dirname(made), f"dask-train-copies-left-p{_dead_pid()}-zz")
        os.mkdir(left)
        again = memory_dir("dask-train-copies-test-job-")
        os.rmdir(again)
        assert not os.path.exists(left)
    finally:
        os.rmdir(made)
