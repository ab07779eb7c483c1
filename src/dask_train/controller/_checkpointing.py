"""The chief's checkpoints: when to take one, the pause that makes it consistent, the manifest.

A checkpoint is taken with every trainer paused at a consistent point (see
``strategies/_state.py``): the parameter servers (rank 0 for sync) write their shards in parallel,
each atomically, then the controller writes ``manifest.json`` last. A checkpoint without a
readable manifest is ignored and later pruned, so a kill mid-write leaves the previous one
loadable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distributed import Client, Future, wait

from dask_train.checkpoint import CheckpointConfig, CheckpointStore
from dask_train.engines import _worker as _state
from dask_train.errors import InvalidInput, TrainingTimeout

logger = logging.getLogger(__name__)


async def run_on_live(client: Client, fn: Any, *args: Any, workers: Sequence[str], **kwargs: Any) -> Any:
    """``client.run`` on those of ``workers`` still alive.

    A call to a dead worker's address waits for the 30 s connect timeout even with
    ``on_error="ignore"``: never send one.
    """
    alive = set((await client.scheduler.identity()).get("workers", {}))
    targets = [w for w in workers if w in alive]
    if not targets:
        return {}
    return await client.run(fn, *args, workers=targets, asynchronous=True, on_error="ignore",
                            **kwargs)


@dataclass
class Restore:
    """What a generation starts from: a checkpoint's manifest and its directory."""

    directory: str
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        """The servers' step count when the checkpoint was taken."""
        return int(self.manifest["step"])

    def shard_files(self, store: CheckpointStore) -> list[dict[str, Any]]:
        """The shard records with their paths resolved against the checkpoint's directory."""
        return [
            {"path": store.shard_path(self.directory, int(f["index"])), "start": int(f["start"]),
             "stop": int(f["stop"])}
            for f in self.manifest["files"]
        ]

    def server_state(self, store: CheckpointStore) -> dict[str, Any]:
        """The ``restore`` argument of the servers (and of sync ranks)."""
        return {"files": self.shard_files(store), "step": self.step,
                "samples": int(self.manifest["samples"])}


def load_restore(store: CheckpointStore, *, n_params: int, strategy: str) -> Restore | None:
    """The newest complete checkpoint, checked against this job; None when there is none."""
    newest = store.newest()
    if newest is None:
        return None
    directory, manifest = newest
    if int(manifest.get("n_params", -1)) != n_params:
        raise InvalidInput([
            f"the checkpoint {directory} holds {manifest.get('n_params')} parameters but the module "
            f"has {n_params}: resume with the module it was written for, or use another "
            "CheckpointConfig(path=...)."
        ])
    if manifest.get("strategy") != strategy:
        logger.info("resuming a %s checkpoint with strategy=%s", manifest.get("strategy"), strategy)
    return Restore(directory, manifest)


@dataclass
class _Pause:
    pause_id: int
    requested_at: float
    paused: dict[int, dict[str, Any]] = field(default_factory=dict)


class Checkpointer:
    """Schedules checkpoints for one generation and writes them.

    Parameters
    ----------
    client : distributed.Client
    config : CheckpointConfig
    job : str
        The generation's job key on the workers.
    generation : int
    timeout : float
        Longest wait for a pause or a shard write.
    """

    def __init__(
        self, client: Client, config: CheckpointConfig, *, job: str, generation: int,
        timeout: float, start_step: int = 0,
    ) -> None:
        self.client, self.config, self.job = client, config, job
        self.generation, self.timeout = generation, timeout
        self.store = CheckpointStore(config)
        self.last_time = time.time()
        self.last_step = start_step
        self.pending: _Pause | None = None
        self.next_id = 1
        self.written: list[dict[str, Any]] = []

    def due(self, *, step: int, now: float) -> bool:
        """True when a checkpoint should be started now."""
        if self.pending is not None:
            return False
        if self.config.every_seconds is not None and now - self.last_time >= self.config.every_seconds:
            # Time is due: the controller's step count (from block events) may lag the servers';
            # the exact step is read after the pause, and an unchanged one skips the write.
            return True
        return step > self.last_step and bool(self.config.due(
            now=now, last_time=self.last_time, step=step, last_step=self.last_step))

    def skip(self) -> None:
        """No progress since the last checkpoint: count this one as taken."""
        self.last_time = time.time()

    async def request(self, workers: Sequence[str]) -> None:
        """Ask every trainer to pause at its next consistent point."""
        self.pending = _Pause(self.next_id, time.time())
        self.next_id += 1
        await run_on_live(self.client, _state.request_pause, self.job, self.pending.pause_id,
                          workers=workers)

    def on_paused(self, event: Mapping[str, Any]) -> None:
        """Record a trainer's pause report."""
        if self.pending is not None and int(event["id"]) == self.pending.pause_id:
            self.pending.paused[int(event["trainer"])] = dict(event)

    def ready(self, running: Sequence[int]) -> bool:
        """True when every trainer still running has paused."""
        if self.pending is None:
            return False
        if time.time() - self.pending.requested_at > self.timeout:
            raise TrainingTimeout(
                f"trainers {sorted(set(running) - set(self.pending.paused))} did not pause for a "
                f"checkpoint within timeout={self.timeout:g} s"
            )
        return all(t in self.pending.paused for t in running)

    async def release(self, workers: Sequence[str]) -> None:
        """Let the paused trainers go on."""
        if self.pending is None:
            return
        pause_id, self.pending = self.pending.pause_id, None
        await run_on_live(self.client, _state.resume, self.job, pause_id, workers=workers)

    @property
    def paused(self) -> dict[int, dict[str, Any]]:
        """The pause reports of the checkpoint in progress."""
        return {} if self.pending is None else self.pending.paused

    async def write(
        self, *, shards: Sequence[Any], manifest: dict[str, Any], pinned: Any
    ) -> dict[str, Any] | None:
        """Have each shard write itself, then write the manifest; None when a shard was not finite.

        ``pinned(fn, address=..., key=..., **kwargs)`` submits a task to one shard's worker.
        """
        step = int(manifest["step"])
        directory = self.store.directory(step, self.generation)
        t0 = time.perf_counter()
        # How long the trainers waited to reach their consistent points (0 for a final one).
        pause_s = time.time() - self.pending.requested_at if self.pending is not None else 0.0
        futures: list[Future] = [
            pinned(_state.save_shard_task, address=ref.address,
                   key=f"dt-save-{self.next_id}-{ref.index}", job=self.job, index=ref.index,
                   path=self.store.shard_path(directory, ref.index),
                   metadata={"step": str(step), "start": str(ref.start), "stop": str(ref.stop)})
            for ref in shards
        ]
        try:
            await wait(futures, timeout=self.timeout)
        except TimeoutError:
            raise TrainingTimeout(
                f"writing checkpoint {directory} took longer than timeout={self.timeout:g} s"
            ) from None
        results = await self.client.gather(futures, asynchronous=True)
        self.last_time, self.last_step = time.time(), step
        if not all(r["finite"] for r in results):
            logger.warning("checkpoint at step %d skipped: the parameters are not finite", step)
            return None
        manifest = {
            # The servers' own counts, taken under their locks while every trainer is paused.
            **manifest, "step": min(int(r["version"]) for r in results),
            "samples": min(int(r["samples"]) for r in results), "generation": self.generation,
            "shards": [f"shard-{ref.index}.safetensors" for ref in shards],
            "files": [{"index": ref.index, "start": ref.start, "stop": ref.stop} for ref in shards],
        }
        loop = asyncio.get_running_loop()
        # File-system calls block: keep them off the event loop that carries the job's messages.
        await loop.run_in_executor(None, self.store.write_manifest, directory, manifest)
        await loop.run_in_executor(None, self.store.prune)
        info = {"directory": directory, "step": manifest["step"], "write_s": time.perf_counter() - t0,
                "pause_s": pause_s, "time": time.time()}
        self.written.append(info)
        logger.info("checkpoint %s written in %.3f s", directory, info["write_s"])
        return info


def patch_positions(ledger_state: dict[str, Any], positions: Mapping[int, Any]) -> dict[str, Any]:
    """The ledger state with the paused trainers' partial blocks counted as consumed so far.

    ``positions`` maps trainer -> [epoch, block, rows] (rows applied, skip included).
    """
    where = {(int(p[0]), int(p[1])): int(p[2]) for p in positions.values() if p is not None}
    fields = list(ledger_state["entry_fields"])
    epoch, block = fields.index("epoch"), fields.index("block")
    consumed, done = fields.index("consumed"), fields.index("done")
    for entry in ledger_state["entries"]:
        key = (int(entry[epoch]), int(entry[block]))
        if key in where and not entry[done]:
            entry[consumed] = where[key]
    return ledger_state


def check_checkpoint_config(config: object) -> list[str]:
    """Problems with the ``checkpoint=`` argument of a Trainer."""
    if config is None or isinstance(config, CheckpointConfig):
        return []
    return [
        f"checkpoint={config!r} is invalid: pass dt.CheckpointConfig(path, every_seconds=..., "
        "keep=...) or None."
    ]
