"""TensorBoard event files written by the controller, in the client process.

Why this writer: the event files are written with the ``tensorboard`` package's own record
writer and protocol buffers (``tensorboard.summary.writer.record_writer``,
``tensorboard.compat.proto``), the layer that ``torch.utils.tensorboard.SummaryWriter`` and
``tensorboardX`` both wrap. ``torch.utils.tensorboard`` would make torch a requirement (a Keras
model has none), and its file writer goes through ``tensorboard.compat.tf``, which imports all of
TensorFlow when it is installed (seconds, in the client); ``tensorboardX`` would be one more
dependency. Scalars are all a job writes, and for them the record writer is enough; the files go
through fsspec, so ``log_dir`` may be any URL the checkpoints accept (``s3://bucket/runs/exp1``).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from dask_train.errors import InvalidInput
from dask_train.policy.callbacks import Callback

_files = itertools.count()  # distinguishes two files opened in the same second


class _EventFile:
    """One TensorBoard event file: a version record, then one record per batch of scalars."""

    def __init__(self, log_dir: str) -> None:
        import fsspec
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        fs, path = fsspec.core.url_to_fs(log_dir)
        fs.makedirs(path, exist_ok=True)
        # TensorBoard finds files by this name pattern (the one its own writers use).
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_files)}")
        self.path = f"{path.rstrip('/')}/{name}"
        self._writer = RecordWriter(fs.open(self.path, "wb"))
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Write ``values`` (tag -> number) at ``step``."""
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))
                                       for tag, value in values.items()])
        self._write(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def _write(self, event: Any) -> None:
        self._writer.write(event.SerializeToString())

    def flush(self) -> None:
        """Push what was written to the file (TensorBoard reads it from there)."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close."""
        if not self._writer.closed:
            self._writer.flush()
            self._writer.close()


class TensorBoard(Callback):
    """Write a job's scalars for TensorBoard: per score and per second, from the controller.

    Per score (at the job's step): ``score/<metric>`` for every validation score (``loss``,
    ``accuracy``, your ``metrics=``), ``train/samples_per_s`` (between two scores) and
    ``train/epoch``. Per trainer, about once a second (at the job's step as that trainer saw
    it): ``trainer/<i>/samples_per_s``, ``trainer/<i>/wait_data`` and
    ``trainer/<i>/wait_servers`` (the fraction of the second spent waiting for data, and for the
    parameter servers' replies -- the all-reduce in a sync job); per parameter-server shard,
    ``ps/<i>/updates_per_s``. Only the controller writes, in the client process: the trainers
    send their figures as Dask events, so no worker needs the log directory.

    Each fit writes a new event file in ``log_dir``; give each run its own directory to compare
    runs side by side (``tensorboard --logdir runs``).

    Parameters
    ----------
    log_dir : str or os.PathLike
        Directory for the event files: a local path or any fsspec URL.
    flush_secs : float
        Longest time written scalars wait before they reach the file (and TensorBoard).
    per_role : bool
        Also write the per-trainer and per-server scalars.

    Examples
    --------
    >>> import dask_train as dt
    >>> trainer = dt.Trainer(net, callbacks=[dt.callbacks.TensorBoard("runs/exp1")])  # doctest: +SKIP
    >>> trainer.fit(X, y, validation=(Xv, yv))                                  # doctest: +SKIP

    Then ``tensorboard --logdir runs``.
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, flush_secs: float = 2.0,
                 per_role: bool = True) -> None:
        problems = []
        if not isinstance(log_dir, (str, os.PathLike)) or not str(log_dir):
            problems.append(f"log_dir={log_dir!r} is invalid: pass a directory path or URL, "
                            "e.g. TensorBoard('runs/exp1').")
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) \
                or not flush_secs > 0:
            problems.append(f"flush_secs={flush_secs!r} is invalid: use a number of seconds > 0.")
        if problems:
            raise InvalidInput(problems)
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError("dt.callbacks.TensorBoard needs the tensorboard package: "
                              "pip install 'dask-train[monitor]' (or pip install tensorboard)")
        self.log_dir = os.fspath(log_dir)
        self.flush_secs, self.per_role = float(flush_secs), per_role
        self.file: _EventFile | None = None
        self._flushed = 0.0

    def on_fit_start(self, info: Mapping[str, Any]) -> None:
        """Open a new event file for this fit."""
        self.close()
        self.file = _EventFile(self.log_dir)
        self._flushed = time.monotonic()

    def on_score(self, record: Mapping[str, Any]) -> bool | None:
        """Write the score record's metrics, throughput and epoch."""
        values = {f"score/{name}": value for name, value in record.items()
                  if name not in _NOT_SCORES and _is_number(value)}
        for name, tag in (("samples_per_s", "train/samples_per_s"), ("epoch", "train/epoch")):
            if _is_number(record.get(name)):
                values[tag] = record[name]
        self._write(int(record.get("step", 0)), values)
        return None

    def on_stats(self, stats: Mapping[str, Any]) -> None:
        """Write one trainer's, server's or the scorer's figures for its last interval."""
        if not self.per_role:
            return
        index, interval = int(stats.get("index", 0)), float(stats.get("interval_s") or 0.0)
        if interval <= 0:
            return
        if stats.get("role") == "ps":
            values = {f"ps/{index}/updates_per_s": stats.get("updates", 0) / interval}
        elif stats.get("role") == "scorer":  # the cores it took scoring
            values = {"scorer/cpu_share": stats.get("cpu_s", 0) / interval}
        else:
            values = {f"trainer/{index}/samples_per_s": stats.get("samples", 0) / interval,
                      f"trainer/{index}/wait_data": min(1.0, stats.get("feed_wait_s", 0) / interval),
                      f"trainer/{index}/wait_servers":
                          min(1.0, stats.get("server_wait_s", 0) / interval)}
        self._write(int(stats.get("step", 0)), values)

    def on_fit_end(self, result: Any) -> None:
        """Close the fit's event file."""
        self.close()

    def close(self) -> None:
        """Flush and close the current event file, if any."""
        if self.file is not None:
            self.file.close()
            self.file = None

    def _write(self, step: int, values: Mapping[str, float]) -> None:
        if self.file is None:  # used without on_fit_start (called by hand): open on first use
            self.on_fit_start({})
        assert self.file is not None
        if values:
            self.file.scalars(step, values)
        now = time.monotonic()
        if now - self._flushed >= self.flush_secs:
            self.file.flush()
            self._flushed = now


# History columns that are not validation scores.
_NOT_SCORES = {"time_s", "step", "epoch", "samples", "samples_per_s"}


def _is_number(value: Any) -> bool:
    """A finite real number, never a bool. A history row's NaN is a placeholder (a metric the
    model does not produce, a rate with no interval yet): non-finite scores never reach it."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
