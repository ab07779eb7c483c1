"""Small modules shared by the strategy tests; importable by the worker processes too."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _host_memory(on: bool) -> None:
    import dask

    dask.config.set({"dask-train.host-memory": on})


@contextlib.contextmanager
def over_the_network(client: Any) -> Iterator[None]:
    """Trainers push to their shards over the network even on the shard's own host (the path of
    trainers on other hosts), as with ``dask-train.host-memory: false`` in the workers' config."""
    client.run(_host_memory, False)
    try:
        yield
    finally:
        client.run(_host_memory, True)


def mlp(n_in: int = 64, hidden: int = 32, n_out: int = 10, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(n_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, n_out))


class Recorder(torch.nn.Module):
    """A linear classifier that appends the ids (column 0) of every training batch to a file.

    Each worker process writes its own file, so the test can read back exactly which samples the
    model was trained on, wherever it ran.
    """

    def __init__(self, directory: str, n_in: int, n_out: int) -> None:
        super().__init__()
        self.directory = directory
        self.linear = torch.nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            path = Path(self.directory) / f"ids-{os.getpid()}.txt"
            with path.open("a") as f:
                np.savetxt(f, x[:, 0].detach().numpy().astype(np.int64), fmt="%d")
        return self.linear(x)


class DiesAt(torch.nn.Module):
    """Wraps a module; the worker process ``pid`` SIGKILLs itself at its ``batches``-th training
    forward, i.e. mid-epoch however fast the job trains.

    A kill from a callback at a score can land after a fast job has already ended (its first score
    is its last); this one lands while that process trains. Other processes (their own copies, a
    restarted worker's new pid) train normally, and scoring (eval mode) counts nothing.
    """

    def __init__(self, module: torch.nn.Module, pid: int, batches: int) -> None:
        super().__init__()
        self.module = module
        self.pid, self.batches, self.seen = pid, batches, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and os.getpid() == self.pid:
            self.seen += 1
            if self.seen >= self.batches:
                import signal

                os.kill(self.pid, signal.SIGKILL)
        return self.module(x)


class Slow(torch.nn.Module):
    """Wraps a module; each training forward first sleeps ``seconds`` (not CPU), so a job runs
    at a known, low rate whatever the machine: for tests of what happens over time."""

    def __init__(self, module: torch.nn.Module, seconds: float) -> None:
        super().__init__()
        self.module, self.seconds = module, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            import time

            time.sleep(self.seconds)
        return self.module(x)
