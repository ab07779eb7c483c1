"""Closing a shard's segment while a thread of the process is inside an update (a job dropped
by Ctrl-C while its trainer pushed) leaves the segment's lock free for the other processes."""

from __future__ import annotations

import fcntl
import os
import threading
import time
import uuid

import pytest

from dask_train.engines.holders import host_memory
from dask_train.engines.holders.host_memory import HostSegment


def _free(path: str) -> bool:
    """Whether another open of ``path`` (as another process's) can take its lock now."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_close_during_an_update_leaves_the_lock_free() -> None:
    path = f"/dev/shm/dask-train-test-close-{uuid.uuid4().hex[:8]}"
    owner = HostSegment.create_shard(path, n=16, n_buffers=None, state={}, extra={})
    try:
        trainer = HostSegment.attach(path)
        assert trainer is not None
        params = trainer.array("params")  # the trainer's tensors view the mapping, as in a job
        inside, errors = threading.Event(), []

        def update() -> None:
            trainer.acquire()
            inside.set()
            time.sleep(0.3)
            try:
                trainer.release()
            except (OSError, ValueError) as exc:  # its descriptor was closed under it
                errors.append(exc)

        thread = threading.Thread(target=update)
        thread.start()
        assert inside.wait(10)
        started = time.monotonic()
        trainer.close()  # drop_job, from the worker's event loop
        waited = time.monotonic() - started
        thread.join(10)
        assert not errors
        assert 0.1 < waited < host_memory.CLOSE_WAIT_S
        assert _free(path)  # the other processes' next update goes on
        assert params.size == 16
    finally:
        owner.close()
    assert not os.path.exists(path)
