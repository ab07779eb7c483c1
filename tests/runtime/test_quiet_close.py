"""A worker that closes with a heartbeat in flight logs no error once dask-train's plugin is on
it (a fresh-clone `.ci/run` saw "Failed to communicate with scheduler during heartbeat." and its
traceback at the end of the README quickstart, on a loaded machine).

Each case runs in a process of its own, a real scheduler and worker in it, the scheduler's
heartbeat handler slowed so that the worker closes while its heartbeat waits; without the plugin
the same moment logs the error, so the race is reproduced on every run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

_SCRIPT = textwrap.dedent("""
    import asyncio, logging, sys
    from distributed import Client, Scheduler, Worker
    from dask_train.runtime._plugin import DaskTrainPlugin

    logging.basicConfig(level=logging.WARNING)

    async def main(plugin):
        async with Scheduler(dashboard_address=":0") as s:
            worker = await Worker(s.address)
            if plugin:
                async with Client(s.address, asynchronous=True) as client:
                    await client.register_plugin(DaskTrainPlugin(), name="dask-train")
            answer = s.handlers["heartbeat_worker"]

            async def slow(*args, **kwargs):
                await asyncio.sleep(1.0)
                return answer(*args, **kwargs)

            s.handlers["heartbeat_worker"] = slow
            beat = asyncio.ensure_future(worker.heartbeat())
            await asyncio.sleep(0.2)
            await worker.close()  # the heartbeat is still waiting for its answer
            await beat
            print("closed", worker.status.name)

    asyncio.run(main(sys.argv[1] == "plugin"))
""")


@pytest.mark.parametrize("plugin", [True, False], ids=["with-plugin", "without"])
def test_a_heartbeat_cut_by_its_worker_closing_is_no_error(plugin: bool, tmp_path: Path) -> None:
    script = tmp_path / "close.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), "plugin" if plugin else "bare"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "closed closed" in log, log[-3000:]
    failed = "Failed to communicate with scheduler during heartbeat" in log
    if plugin:
        assert not failed and "Traceback" not in log and "- ERROR -" not in log, log[-3000:]
    else:
        assert failed, "the race did not happen without the plugin: the test tests nothing"


def test_a_batched_stream_closed_by_its_peer_logs_its_line_without_a_traceback() -> None:
    # What distributed.batched logs when a cluster closes while it still sends (seen at the end of
    # a script on the embedded cluster, logging at INFO): one line, and no traceback once
    # dask-train is on the process. Other records of that logger keep their traceback.
    import io
    import logging

    from distributed.comm.core import CommClosedError

    from dask_train.runtime._plugin import quiet_batched_close

    log = logging.getLogger("distributed.batched")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    log.addHandler(handler)
    try:
        quiet_batched_close()
        quiet_batched_close()  # installed once however often it is asked
        for exc, msg in ((CommClosedError(), "Batched Comm Closed %r"),
                         (ValueError("a real problem"), "Batched send failed %r")):
            try:
                raise exc
            except Exception:
                log.warning(msg, "<TCP (closed)>", exc_info=True)
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    assert "Batched Comm Closed '<TCP (closed)>'" in text
    assert "CommClosedError" not in text
    assert "Traceback" in text and "ValueError: a real problem" in text  # the other record's
    assert len([f for f in log.filters if type(f).__name__ == "_BatchedClosed"]) == 1
