"""The client's own log filters (runtime/_quiet_logs.quiet_client): what they leave out and
what they keep, with asyncio's real "never retrieved" records."""

from __future__ import annotations

import asyncio
import gc
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from tornado import gen

from dask_train.runtime._quiet_logs import quiet_client

sys.path.insert(0, str(Path(__file__).parents[1] / "controller"))
from _dask_cli import scheduler_address  # noqa: E402


def _orphan_tornado_timeout() -> None:
    """A ``tornado.gen.with_timeout`` wait whose waiter went away before its time was up, as a
    BatchedSend's dropped coroutine leaves it: the timeout fires, no one reads it."""

    async def main() -> None:
        gen.with_timeout(0.01, asyncio.get_running_loop().create_future())
        await asyncio.sleep(0.05)

    asyncio.run(main())
    gc.collect()


def _orphan_other_error() -> None:
    async def main() -> None:
        asyncio.get_running_loop().create_future().set_exception(ValueError("kept"))

    asyncio.run(main())
    gc.collect()


@pytest.mark.parametrize("quiet", [False, True])
def test_tornados_orphaned_timeout_is_left_out_and_nothing_else(
        quiet: bool, caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("asyncio")
    before = list(log.filters)
    try:
        if quiet:
            quiet_client()
        else:  # the same process without the filters: the record is there to leave out
            log.filters = [f for f in log.filters if type(f).__module__ !=
                           "dask_train.runtime._quiet_logs"]
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            _orphan_tornado_timeout()
            _orphan_other_error()
    finally:
        log.filters = before
    messages = [(r.getMessage(), repr(r.exc_info[1]) if r.exc_info else "")
                for r in caplog.records if r.name == "asyncio"]
    timeouts = [m for m in messages if "TimeoutError('Timeout')" in m[1]]
    others = [m for m in messages if "ValueError('kept')" in m[1]]
    assert len(others) == 1, messages  # any other unretrieved exception is still logged
    assert len(timeouts) == (0 if quiet else 1), messages



_REMOTE_CLIENT = """
import logging
import sys

import dask_train as dt

client = dt.connect(sys.argv[1], quiet=True)
print(sorted(type(f).__name__ for f in logging.getLogger("distributed.batched").filters))
client.close()
"""


def test_a_client_of_a_dask_scheduler_drops_its_streams_close_traceback(tmp_path: Path) -> None:
    # The client's own batched stream logs "Batched Comm Closed" with a CommClosedError traceback
    # when a message queued after its close-stream meets the scheduler's closed end
    # (dask/distributed#7192; seen after Ctrl-C in a script on a `dask scheduler`, under load).
    # No scheduler or worker runs in that process to install the filter: the client does.
    script, info = tmp_path / "remote.py", tmp_path / "scheduler.json"
    script.write_text(_REMOTE_CLIENT)
    with (tmp_path / "scheduler.log").open("wb") as log:
        scheduler = subprocess.Popen(
            [str(Path(sys.executable).parent / "dask"), "scheduler", "--port", "0",
             "--dashboard-address", ":0", "--scheduler-file", str(info)], stdout=log, stderr=log)
        try:
            done = subprocess.run([sys.executable, str(script), scheduler_address(info)],
                                  capture_output=True, text=True, timeout=120, cwd=tmp_path)
        finally:
            scheduler.terminate()
            scheduler.wait(30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['_BatchedClosed']", done.stdout + done.stderr
