"""The client's own log filters (runtime/_quiet_logs.quiet_client): what they leave out and
what they keep, with asyncio's real "never retrieved" records."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest
from tornado import gen

from dask_train.runtime._quiet_logs import quiet_client


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
