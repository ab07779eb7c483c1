"""A worker that closes with a heartbeat in flight logs no error once dask-train's plugin is on
it (a fresh-clone `.ci/run` saw "Failed to communicate with scheduler during heartbeat." and its
traceback at the end of the README quickstart, on a loaded machine).

Each case runs in a process of its own, a real scheduler and worker in it, the scheduler's
heartbeat handler slowed so that the worker closes while its heartbeat waits; without the plugin
the same moment logs the error, so the race is reproduced on every run.
"""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _run_script(tmp_path: Path, text: str, *args: str) -> tuple[int, str]:
    """Run ``text`` as a script in a process of its own (dask-train importable): its exit code
    and its whole output."""
    script = tmp_path / "script.py"
    script.write_text(text)
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    return proc.returncode, proc.stdout + proc.stderr


def _logged(name: str, emit: Callable[[logging.Logger], None]) -> str:
    """What ``emit(logger)`` writes to the logger ``name``, as "LEVEL message" lines."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger(name)
    log.addHandler(handler)
    try:
        emit(log)
    finally:
        log.removeHandler(handler)
    return stream.getvalue()

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
    code, log = _run_script(tmp_path, _SCRIPT, "plugin" if plugin else "bare")
    assert code == 0 and "closed closed" in log, log[-3000:]
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

    from dask_train.runtime._quiet_logs import quiet_batched_close

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


_PEER_SCRIPT = textwrap.dedent("""
    import logging
    from distributed import Client, LocalCluster
    from dask_train.runtime._roles import ensure_plugin

    logging.basicConfig(level=logging.WARNING)

    def peer_gone():
        raise ConnectionResetError("Connection reset: rank 0's process (4242) is gone")

    def own_error():
        raise ValueError("a bug in the rank's own code")

    if __name__ == "__main__":
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            ensure_plugin(client)
            for key, fn in (("dt-trainer-1-job-g0", peer_gone), ("dt-trainer-0-job-g0", own_error)):
                try:
                    client.submit(fn, key=key, pure=False).result()
                except Exception as exc:
                    print("raised", type(exc).__name__)
""")


def test_a_role_failed_by_its_peers_death_logs_no_error_and_its_own_error_does(
        tmp_path: Path) -> None:
    # A sync rank's collective fails when a peer is killed: the job reports the peer's loss,
    # and the survivor's "Compute Failed" ERROR (with its traceback) is left out; an error of
    # the rank's own code is still logged, as any task's.
    code, log = _run_script(tmp_path, _PEER_SCRIPT)
    assert code == 0, log[-3000:]
    assert "raised ConnectionResetError" in log and "raised ValueError" in log, log[-3000:]
    assert "dt-trainer-1-job-g0" not in log, log[-3000:]  # the peer's death: not logged
    assert "Compute Failed" in log and "dt-trainer-0-job-g0" in log, log[-3000:]


def test_lost_blocks_that_dask_train_sends_again_are_no_error() -> None:
    # The scheduler's line when a killed worker held scattered data: at ERROR, "can't be
    # recovered". dask-train sends its own blocks again (dt-sent- keys), so that line is INFO;
    # any other scattered key lost keeps Dask's ERROR.
    import io
    import logging

    from dask_train.data._scatter import RESENT_PREFIX
    from dask_train.runtime._quiet_logs import quiet_scheduler

    log = logging.getLogger("distributed.scheduler")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(handler)
    line = ("Removing worker 'tcp://127.0.0.1:1' caused the cluster to lose scattered data, "
            "which can't be recovered: {keys} (stimulus_id='handle-worker-cleanup-1')")
    try:
        quiet_scheduler()
        quiet_scheduler()  # installed once however often it is asked
        log.error(line.format(keys=f"{{'{RESENT_PREFIX}a1', '{RESENT_PREFIX}b2'}}"))
        log.error(line.format(keys=f"{{'{RESENT_PREFIX}a1', 'tuple-9f'}}"))
    finally:
        log.removeHandler(handler)
    first, second = out.getvalue().splitlines()
    assert first.startswith("INFO ") and "which dask-train sends again from its client" in first
    assert second.startswith("ERROR ") and "can't be recovered" in second
    assert len([f for f in log.filters if type(f).__name__ == "_ResentData"]) == 1


def test_a_closed_workers_stop_queue_read_at_its_exit_is_no_error() -> None:
    # distributed's nanny thread in a worker process reads its stop queue; a worker that closed
    # by itself (--lifetime) closes that queue on its way out under the read, and distributed
    # logged "Worker process died unexpectedly" with a TypeError traceback (half of the lifetime
    # workers' exits in the departure tests). Once the worker has closed it is an INFO line.
    import asyncio

    from distributed import Scheduler, Worker

    from dask_train.runtime._quiet_logs import quiet_worker

    def died() -> str:
        def emit(log: logging.Logger) -> None:
            try:
                raise TypeError("'NoneType' object cannot be interpreted as an integer")
            except TypeError:
                log.exception("Worker process died unexpectedly")

        return _logged("distributed.nanny", emit)

    async def main() -> tuple[str, str]:
        async with Scheduler(dashboard_address=":0") as s:
            worker = await Worker(s.address)
            quiet_worker(worker)
            running = died()
            await worker.close()
            return running, died()

    running, closed = asyncio.run(main())
    assert running.startswith("ERROR Worker process died unexpectedly") and "Traceback" in running
    assert closed.startswith("INFO the worker's stop queue was closed") and "Traceback" not in closed


_TRANSFER_SCRIPT = textwrap.dedent("""
    import asyncio, logging, sys
    from distributed import Client, Scheduler, Worker
    from distributed.core import Status
    from dask_train.runtime._plugin import DaskTrainPlugin

    async def main(plugin):
        async with Scheduler(dashboard_address=":0") as s:
            a = await Worker(s.address, nthreads=1)
            b = await Worker(s.address, nthreads=1)
            async with Client(s.address, asynchronous=True) as client:
                if plugin:
                    await client.register_plugin(DaskTrainPlugin(), name="dask-train")
                x = client.submit(lambda: b"x" * 1000, key="x", workers=[a.address],
                                  allow_other_workers=True)
                await x
                serve = a.handlers["get_data"]

                async def slow(*args, **kwargs):
                    await asyncio.sleep(1.0)  # B's fetch stays in flight
                    return await serve(*args, **kwargs)

                a.handlers["get_data"] = slow
                y = client.submit(len, x, key="y", workers=[b.address])
                while not b.state.in_flight_workers:
                    await asyncio.sleep(0.01)
                # What retire_workers(remove=True) does once A's data has a copy elsewhere
                # (A retiring): B's fetch from A is cut, and A's answer finds its end closed.
                a.status = Status.closing_gracefully
                await s.remove_worker(a.address, stimulus_id="retire-test", close=False)
                await asyncio.sleep(1.5)
                await a.close()
                print("fetched", await asyncio.wait_for(y, 20))
            await b.close()

    asyncio.run(main(sys.argv[1] == "plugin"))
""")


@pytest.mark.parametrize("plugin", [True, False], ids=["with-plugin", "without"])
def test_a_transfer_cut_by_its_sender_retiring_is_no_error(plugin: bool, tmp_path: Path) -> None:
    # A retiring worker is removed by the scheduler without waiting for peers still fetching
    # from it; distributed then logs the cut fetch as ERRORs with tracebacks on both workers
    # (seen on a `dask worker --lifetime` departure under load), though the peer fetches the
    # data again. With dask-train's plugin they are INFO lines; without it the race is shown
    # to happen on every run.
    code, log = _run_script(tmp_path, _TRANSFER_SCRIPT, "plugin" if plugin else "bare")
    assert code == 0, log[-3000:]
    cut = "Worker stream died during communication" in log
    assert cut, "the fetch was not cut: the test tests nothing\n" + log[-3000:]
    if plugin:
        assert "ERROR" not in log and "Traceback" not in log, log[-3000:]
        assert "it was removed from the cluster as it left" in log, log[-3000:]
    else:
        assert "- ERROR - Worker stream died during communication" in log, log[-3000:]


def test_a_retiring_workers_cut_answer_is_no_error_and_a_running_ones_is() -> None:
    # The other end of the cut fetch above: the retiring worker's own "failed during get data"
    # (seen beside it on the `--lifetime` departure). While the worker leaves it is an INFO
    # line; the same failure of a running worker keeps distributed's ERROR and traceback.
    import asyncio

    from distributed import Scheduler, Worker
    from distributed.core import Status

    from dask_train.runtime._quiet_logs import quiet_worker

    def failed(address: str) -> str:
        def emit(log: logging.Logger) -> None:
            try:
                raise OSError("Stream is closed")
            except OSError:
                log.exception("failed during get data with %s -> %s", address, "tcp://peer:1")

        return _logged("distributed.worker", emit)

    async def main() -> tuple[str, str]:
        async with Scheduler(dashboard_address=":0") as s:
            worker = await Worker(s.address)
            quiet_worker(worker)
            running = failed(worker.address)
            worker.status = Status.closing_gracefully
            leaving = failed(worker.address)
            await worker.close()
            return running, leaving

    running, leaving = asyncio.run(main())
    assert running.startswith("ERROR failed during get data") and "Traceback" in running
    assert leaving.startswith("INFO failed during get data") and "Traceback" not in leaving
    assert "this worker is leaving the cluster" in leaving
