"""Worker side of every engine's roles: stop signals, checkpoint pauses, saves and restores, RNGs.

The controller (the chief) decides when to checkpoint. It raises the job's pause id on every
trainer's worker; each trainer pauses at its next consistent point (no gradient half-accumulated,
no push in flight; a sync job's ranks all after the same step), reports where it is in its data
and its RNG state, and waits. With every trainer paused, each parameter server writes its own
shard in parallel, the controller writes the manifest last, and resumes the trainers.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from distributed import get_worker

from dask_train.runtime._plugin import worker_state


def request_pause(job: str, pause_id: int, dask_worker: Any = None) -> None:
    """Run on workers (``client.run``): ask the job's trainers to pause for checkpoint ``pause_id``."""
    state = worker_state(dask_worker).job(job)
    state.pause_id = max(state.pause_id, int(pause_id))


def resume(job: str, pause_id: int, dask_worker: Any = None) -> None:
    """Run on workers (``client.run``): let trainers paused for ``pause_id`` go on."""
    state = worker_state(dask_worker).job(job)
    state.resume_id = max(state.resume_id, int(pause_id))


def shard_positions(job: str, index: int, trainer: int, dask_worker: Any = None) -> list[list[int]]:
    """Run on a server's worker: [epoch, block, rows] applied to shard ``index`` per recent block
    of ``trainer``."""
    state = worker_state(dask_worker).jobs.get(job)
    shard = None if state is None else state.params.get(index)
    seen = getattr(shard, "positions", {}).get(trainer, {})
    return [[e, b, rows] for (e, b), rows in seen.items()]


def shard_version(job: str, index: int, dask_worker: Any = None) -> int:
    """Run on a server's worker: the update count of shard ``index`` (-1 when it is not there)."""
    state = worker_state(dask_worker).jobs.get(job)
    shard = None if state is None else state.params.get(index)
    return int(getattr(shard, "version", -1))


def save_shard_task(*, job: str, index: int, path: str, metadata: Mapping[str, str]) -> dict[str, Any]:
    """Dask task on a server's worker: write shard ``index`` (parameters and optimizer state)."""
    worker = get_worker()
    state = worker_state(worker).job(job)
    result: dict[str, Any] = state.holder(index, address=worker.address, job=job).save(
        path, metadata=metadata)
    return result


def signal_stop(
    job: str, *, scorer: bool = False, keep_step: int | None = None, dask_worker: Any = None
) -> None:
    """Run on workers (``client.run``): ask the job's trainers, or its scorer, to stop.

    ``keep_step`` tells the scorer which scored snapshot to hand back as the result's model.
    """
    state = worker_state(dask_worker).job(job)
    if scorer:
        state.scorer_keep = keep_step
        state.scorer_stop.set()
    else:
        state.stop.set()


def drop_job(job: str, dask_worker: Any = None) -> None:
    """Run on workers (``client.run``): forget a finished job and free its memory."""
    worker_state(dask_worker).drop(job)


def model_for(module: Any, address: str, config: Mapping[str, Any]) -> Any:
    """The model adapter a role on ``address`` trains or scores with: a copy of ``module`` on the
    device the controller chose for that worker (``config["devices"]``), in the job's precision.
    """
    import copy

    from dask_train.models._flat import flat_model

    device = (config.get("devices") or {}).get(address)
    if device is None and config.get("device_kind") == "cuda":
        device = "cuda"  # a worker that joined after the start: its current CUDA device
    return flat_model(copy.deepcopy(module), device=device, precision=config.get("precision"))


def rng_state() -> str:
    """This process's torch RNG state as text (it travels in an event and a JSON manifest)."""
    import torch

    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii")


def set_rng_state(text: str) -> None:
    """Restore a state from :func:`rng_state`."""
    import torch

    raw = bytearray(base64.b64decode(text))
    torch.set_rng_state(torch.frombuffer(raw, dtype=torch.uint8).clone())


def seed_trainer(*, seed: int, index: int, saved: Mapping[str, str] | None) -> None:
    """Seed torch's RNG (dropout, random layers) per trainer, or restore a checkpointed state.

    Seeding makes a run reproducible from its seed; restoring makes a resumed run continue the
    uninterrupted one's random stream.
    """
    import torch

    text = (saved or {}).get(str(index))
    if text:
        set_rng_state(text)
    else:
        torch.manual_seed(int(seed) * 1_000_003 + index)


class Pauser:
    """A trainer's side of checkpoint pauses.

    Parameters
    ----------
    worker : distributed.Worker
    state : JobState
        The job's state on this worker (pause and resume ids live there).
    topic : str
        The job's event topic.
    trainer : int
    timeout : float
        Longest wait for the controller to resume.
    """

    def __init__(self, worker: Any, state: Any, *, topic: str, trainer: int, timeout: float) -> None:
        self.worker, self.state, self.topic = worker, state, topic
        self.trainer, self.timeout = trainer, timeout
        self.handled = 0

    def requested(self) -> bool:
        """True when the controller asked for a pause this trainer has not taken yet."""
        return bool(self.state.pause_id > self.handled)

    def pause(self, position: list[int] | None, *, steps: int, pause_id: int | None = None) -> bool:
        """Report ``position`` ([epoch, block, rows] or None between blocks) and wait.

        Returns False when the job was stopped while paused.
        """
        self.handled = int(pause_id if pause_id is not None else self.state.pause_id)
        self.worker.log_event(self.topic, {
            "kind": "paused", "trainer": self.trainer, "id": self.handled, "position": position,
            "rng": rng_state(), "steps": steps,
        })
        return bool(self.state.wait_resume(self.handled, timeout=self.timeout))


class NanReporter:
    """Reports non-finite losses to the controller: the first few in full, then a count."""

    def __init__(self, worker: Any, *, topic: str, trainer: int, limit: int = 5) -> None:
        self.worker, self.topic, self.trainer, self.limit = worker, topic, trainer, limit
        self.count = 0

    def report(self, *, loss: float, step: int, epoch: int, block: int) -> None:
        """Publish one non-finite loss (silently counted after ``limit`` reports)."""
        self.count += 1
        if self.count <= self.limit:
            self.worker.log_event(self.topic, {
                "kind": "nan", "trainer": self.trainer, "loss": str(loss), "step": step,
                "epoch": epoch, "block": block, "count": self.count,
            })
