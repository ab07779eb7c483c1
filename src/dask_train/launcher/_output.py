"""The ranks' output of a ``dt.launch`` run, as it arrives on the run's event topic: printed
with each line's rank and kept in the run's directory, in torchrun's layout."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import IO, Any


class Output:
    """The ranks' lines: printed as they arrive (``[rank1]: ...``, stdout's to stdout and
    stderr's to stderr, as torchrun's ``--tee``) and kept under ``log_dir``."""

    def __init__(self, log_dir: Path, *, echo: bool) -> None:
        self.log_dir, self.echo = log_dir, echo
        self.files: dict[tuple[int, int, str], IO[str]] = {}
        self.ended: set[tuple[int, int]] = set()  # (attempt, rank) whose exit event came
        self.lock = threading.Lock()

    def on_event(self, event: Any) -> None:
        """Client event handler: one rank's batch of lines, or its end."""
        msg = event[1] if isinstance(event, tuple) else event
        rank, attempt = int(msg["rank"]), int(msg["attempt"])
        with self.lock:
            if "exit" in msg:
                self.ended.add((attempt, rank))
                return
            for stream, text in msg.get("lines", ()):
                self._file(attempt, rank, stream).write(text + "\n")
                if self.echo:
                    out = sys.stderr if stream == "stderr" else sys.stdout
                    out.write(f"[rank{rank}]: {text}\n")
            for key, handle in self.files.items():
                if key[:2] == (attempt, rank):
                    handle.flush()
            if self.echo:
                sys.stdout.flush()
                sys.stderr.flush()

    def _file(self, attempt: int, rank: int, stream: str) -> IO[str]:
        key = (attempt, rank, stream)
        if key not in self.files:
            path = self.log_dir / f"attempt_{attempt}" / str(rank) / f"{stream}.log"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.files[key] = path.open("a", encoding="utf-8")
        return self.files[key]

    def path(self, attempt: int, rank: int, stream: str) -> Path:
        """Where rank ``rank``'s ``stream`` of attempt ``attempt`` is kept."""
        return self.log_dir / f"attempt_{attempt}" / str(rank) / f"{stream}.log"

    def close(self) -> None:
        """Close the run's log files."""
        with self.lock:
            for handle in self.files.values():
                handle.close()
            self.files.clear()
