"""Ctrl-C during a fit, as a user presses it: the job ends at once, its roles stop, one line says
where it can resume, and the cluster's workers are free for the next fit.

A script file runs with ``python script.py`` and gets SIGINT mid-training, on the embedded
cluster and on ``dask scheduler`` / ``dask worker`` processes. The child gets SIGINT's default
back before Python starts: a background job of a non-interactive shell (a CI runner's) starts
with SIGINT ignored, and Python would then never raise ``KeyboardInterrupt``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt
from dask_train.controller import _interrupt
from dask_train.controller._controller import Controller
from dask_train.controller._interrupt import job_tasks_running
from dask_train.data._cluster import live_workers
from dask_train.policy._placement import Roles

sys.path.insert(0, str(Path(__file__).parent))
from _dask_cli import dask_cli_cluster  # noqa: E402
from _fake_engine import _spec  # noqa: E402

SCRIPT = textwrap.dedent('''
    import sys

    import numpy as np
    import torch

    import dask_train as dt


    class SayTraining(dt.Callback):
        said = False

        def on_stats(self, stats):
            if not self.said:
                self.said = True
                print("training", flush=True)


    def main():
        address, path = sys.argv[1], sys.argv[2]
        client = dt.connect(n_workers=2, quiet=True) if address == "embedded" else \\
            dt.connect(address, quiet=True)
        rng = np.random.default_rng(0)
        X = rng.normal(size=(20_000, 16)).astype("float32")
        y = (X[:, 0] > 0).astype("int64")
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        trainer = dt.Trainer(net, loss="cross_entropy", workers=2, batch_size=32, epochs=10_000,
                             checkpoint=dt.CheckpointConfig(path, every_seconds=0.5),
                             callbacks=[SayTraining()], progress=False, client=client)
        trainer.fit(X, y)
        print("fit returned")


    if __name__ == "__main__":
        main()
''')

LINE = re.compile(r"^dask-train: interrupted \(Ctrl-C\).*; resume=True continues from checkpoint "
                  r"(?P<path>\S+) \(step (?P<step>\d+)\)$")


def _restore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_script(tmp_path: Path, address: str) -> tuple[int, str, float]:
    """Run the script, press Ctrl-C once it trains and has a checkpoint; (exit status, output,
    seconds from Ctrl-C to the line)."""
    script, ckpt = tmp_path / "train.py", tmp_path / "ckpt"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), address, str(ckpt)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_restore_sigint)
    lines: list[tuple[float, str]] = []
    training = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            if line.startswith("training"):
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert training.wait(60), "\n".join(line for _, line in lines)
        deadline = time.monotonic() + 20
        while not list(ckpt.glob("*/manifest.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        pressed = time.monotonic()
        proc.send_signal(signal.SIGINT)
        status = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    said = [t for t, line in lines if line.startswith("dask-train: interrupted")]
    return status, "\n".join(line for _, line in lines), (said[0] - pressed) if said else -1.0


def _check_output(status: int, output: str, took: float) -> None:
    assert status == -signal.SIGINT, output  # as any Python program that Ctrl-C ends
    interrupted = [line for line in output.splitlines() if line.startswith("dask-train:")]
    assert len(interrupted) == 1, output
    match = LINE.match(interrupted[0])
    assert match is not None, output
    assert (Path(match["path"]) / "manifest.json").exists()
    for word in ("Traceback", "ERROR", "CancelledError", "CommClosedError", "fit returned"):
        assert word not in output, output
    assert 0 <= took < 5, (took, output)  # the roles stopped and the line came in well under


def test_ctrl_c_in_a_script_on_the_embedded_cluster(tmp_path: Path) -> None:
    _check_output(*_interrupt_script(tmp_path, "embedded"))


def test_ctrl_c_in_a_script_on_a_dask_scheduler_leaves_its_workers_free(tmp_path: Path) -> None:
    with dask_cli_cluster(tmp_path) as (address, _):
        with Client(address) as client:
            client.wait_for_workers(2, timeout=30)
            before = set(live_workers(client))
        status, output, took = _interrupt_script(tmp_path, address)
        with Client(address) as client:
            workers = set(live_workers(client))
            busy = client.run(job_tasks_running, "dt-")
            # dt.connect in the script filtered the scheduler's log as the embedded one's:
            # "Batched Comm Closed" without its traceback (a script ending while the scheduler
            # still sends to it printed one there), lost blocks dask-train sends again at INFO.
            quiet = client.run_on_scheduler(lambda: [
                type(f).__name__ for name in ("distributed.batched", "distributed.scheduler")
                for f in __import__("logging").getLogger(name).filters])
            X = np.random.default_rng(1).normal(size=(2_000, 16)).astype("float32")
            result = dt.Trainer(torch.nn.Linear(16, 2), loss="cross_entropy", workers=2,
                                epochs=1, progress=False,
                                client=client).fit(X, (X[:, 0] > 0).astype("int64"))
    _check_output(status, output, took)
    assert workers == before  # the same worker processes, none restarted
    assert {"_BatchedClosed", "_ResentData"} <= set(quiet), quiet
    assert not any(busy.values()), busy  # no role of the interrupted job still runs
    assert result.stopped_by == "epochs=1" and result.samples == 2_000


class _PressCtrlC(dt.Callback):
    """Sends this process SIGINT once the job trains, as Ctrl-C in a notebook does."""

    def __init__(self) -> None:
        self.pressed = False
        self.error: BaseException | None = None

    def on_stats(self, stats: Any) -> None:
        if not self.pressed:
            self.pressed = True
            os.kill(os.getpid(), signal.SIGINT)

    def on_fit_error(self, error: BaseException, partial: Any) -> None:
        self.error = error


def test_ctrl_c_in_a_notebook_leaves_the_client_ready_for_the_next_fit(
        client: Client, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, ctrl_c: None) -> None:
    _notebook_interrupt(client, tmp_path, capsys, monkeypatch)


def _notebook_interrupt(client: Client, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    X = np.random.default_rng(0).normal(size=(4_000, 16)).astype("float32")
    y = (X[:, 0] > 0).astype("int64")
    press = _PressCtrlC()
    trainer = dt.Trainer(torch.nn.Linear(16, 2), loss="cross_entropy", workers=2, epochs=10_000,
                         callbacks=[press], progress=False, client=client)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as raised:
        trainer.fit(X, y)
    took = time.monotonic() - started
    busy = client.run(job_tasks_running, "dt-")
    result = dt.Trainer(torch.nn.Linear(16, 2), loss="cross_entropy", workers=2, epochs=1,
                        progress=False, client=client).fit(X, y)
    assert press.error is raised.value  # on_fit_error heard of it
    assert raised.value.checkpoint is None  # type: ignore[attr-defined]
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("dask-train: interrupted (Ctrl-C)")
    assert line.endswith("; no checkpoint to resume from (checkpoint= keeps one)")
    assert not any(busy.values()), busy
    assert took < 30
    assert result.stopped_by == "epochs=1" and result.samples == 4_000


def _slow_block(block: np.ndarray) -> np.ndarray:
    time.sleep(2.0)  # the data takes its time to compute: Ctrl-C comes while it is persisted
    return block


@pytest.mark.parametrize("door", ["fit", "run"])
def test_ctrl_c_before_training_started_prints_one_line(
        client: Client, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        door: str, ctrl_c: None) -> None:
    import dask.array as da

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    x = np.random.default_rng(0).normal(size=(4_000, 16)).astype("float32")
    X = da.from_array(x, chunks=(1_000, 16)).map_blocks(_slow_block, dtype="float32")
    y = da.from_array((x[:, 0] > 0).astype("int64"), chunks=1_000)
    timer = threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt) as raised:
            if door == "fit":
                dt.Trainer(torch.nn.Linear(16, 2), loss="cross_entropy", workers=2, epochs=1,
                           progress=False, client=client).fit(X, y, data="persist")
            else:
                dt.run(lambda ctx: None, workers=2, data={"train": (X, y)}, client=client)
    finally:
        timer.cancel()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("dask-train: interrupted (Ctrl-C) before training started; nothing was "
                       "trained"), err
    assert raised.value.checkpoint is None  # type: ignore[attr-defined]
    assert "Traceback" not in "\n".join(err)
    # The same client trains next, on the same workers.
    X2 = x[:2_000]
    again = dt.Trainer(torch.nn.Linear(16, 2), loss="cross_entropy", workers=2, epochs=1,
                       progress=False, client=client).fit(X2, (X2[:, 0] > 0).astype("int64"))
    assert again.stopped_by == "epochs=1"


# -- the interrupt's path in the controller, without a cluster -----------------------------------
class _Bar:
    """The job's progress bar: what it was closed with, and what stderr had by then."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys
        self.closed: list[tuple[str, str]] = []

    def update(self, record: dict[str, Any]) -> None:
        pass

    def close(self, reason: str = "") -> None:
        self.closed.append((reason, self.capsys.readouterr().err))


class _Loop:
    def add_callback(self, callback: Any) -> None:
        callback()


class _CtrlCClient:
    """A client whose ``sync`` gets Ctrl-C before the job ran, as distributed's raises it."""

    loop = _Loop()

    def sync(self, call: Any) -> Any:
        call().close()  # the job's coroutine, never started
        raise KeyboardInterrupt


def test_ctrl_c_closes_the_progress_bar_before_the_line_under_it(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    monkeypatch.setattr(_interrupt, "CLEANUP_S", 0.0)  # no job ran: nothing to wait for
    bar = _Bar(capsys)
    controller = Controller(_CtrlCClient(), _spec(), make_engine=lambda *a: None,  # type: ignore[arg-type]
                            plan_roles=lambda alive: Roles(), roles=Roles({"trainer": ["w"]}),
                            rows=10, progress=bar)
    with pytest.raises(KeyboardInterrupt) as raised:
        controller.run_sync()
    line = capsys.readouterr().err.strip()
    assert bar.closed == [("interrupted", "")]  # closed once, with its reason, before the line
    assert line == str(raised.value)
    assert line.startswith("dask-train: interrupted (Ctrl-C)")


class _Unlisted:
    """``checkpoint=``'s store, which cannot be listed now."""

    class store:  # noqa: N801 - stands for the Checkpoints' store attribute
        @staticmethod
        def newest() -> None:
            raise OSError("the bucket does not answer")


def test_where_a_job_stopped_and_where_it_resumes_are_read_off_its_log() -> None:
    assert _interrupt._where([]) == ""
    assert _interrupt._where([{"step": 3}, {"step": 7, "epoch": 1.25}]) == \
        " at step 7, epoch 1.25"
    assert _interrupt._resume_point(None, written=[{"directory": "d", "step": 1}]) == \
        (None, None)  # no checkpoint=: nothing to resume from, whatever the log says
    written = [{"directory": "/c/step-1", "step": 1}, {"directory": "/c/step-9", "step": 9}]
    unlisted: Any = _Unlisted()
    assert _interrupt._resume_point(unlisted, written=written) == ("/c/step-9", 9)
    assert _interrupt._resume_point(unlisted, written=[]) == (None, None)
