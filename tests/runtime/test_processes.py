"""runtime._processes.pid_alive: the one check that a process of this machine still runs."""

from __future__ import annotations

import os
import subprocess
import sys

from dask_train.runtime._processes import pid_alive


def test_this_process_is_alive() -> None:
    assert pid_alive(os.getpid())


def test_a_process_that_ended_and_was_reaped_is_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid no longer names a process (short of reuse, which takes a while)
    assert not pid_alive(child.pid)


def test_a_process_we_may_not_signal_counts_as_alive() -> None:
    # pid 1 (init) always runs; a user other than root may not signal it (PermissionError).
    assert pid_alive(1)
