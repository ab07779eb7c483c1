"""The chief's checkpoints: when one is due, writing it through the engine, loading the newest.

A checkpoint is taken with every trainer paused at a consistent point (the engine's
pause/snapshot): the engine writes its parameter files (parameter servers in parallel, each
atomically), then the controller writes ``manifest.json`` last. A checkpoint without a readable
manifest is ignored and later pruned, so a kill mid-write leaves the previous one loadable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dask_train.checkpoint import CheckpointConfig, CheckpointStore
from dask_train.controller._state import CheckpointTimes, JobState
from dask_train.engines._protocol import Engine
from dask_train.errors import InvalidInput, TrainingTimeout

logger = logging.getLogger(__name__)


@dataclass
class Restore:
    """What a generation starts from: a checkpoint's manifest and its directory."""

    directory: str
    manifest: dict[str, Any]
    store: CheckpointStore

    @property
    def step(self) -> int:
        """The step count when the checkpoint was taken."""
        return int(self.manifest["step"])

    def engine_state(self) -> dict[str, Any]:
        """What an engine starts from: files (paths resolved), step, samples, ledger, RNG."""
        files = [{"path": self.store.shard_path(self.directory, int(f["index"])),
                  "start": int(f["start"]), "stop": int(f["stop"])}
                 for f in self.manifest["files"]]
        sharded = self.manifest.get("sharded")
        return {"files": files, "step": self.step, "samples": int(self.manifest["samples"]),
                "ledger": self.manifest["ledger"], "rng": self.manifest.get("rng") or {},
                # Each rank's shard of a dt.run state, in torch.distributed.checkpoint's format.
                **({"sharded": {**sharded, "path": f"{self.directory.rstrip('/')}/"
                                                   f"{sharded['dir']}"}} if sharded else {})}


class Checkpoints:
    """Schedules, writes and loads one job's checkpoints.

    Parameters
    ----------
    config : CheckpointConfig
    timeout : float
        Longest wait for the trainers to pause.
    """

    def __init__(self, config: CheckpointConfig, *, timeout: float) -> None:
        self.config, self.timeout = config, timeout
        self.store = CheckpointStore(config)

    def due(self, state: JobState | CheckpointTimes, *, step: int, now: float) -> bool:
        """True when a checkpoint should be started now."""
        if self.config.every_seconds is not None and \
                now - state.last_checkpoint_time >= self.config.every_seconds:
            # Time is due: the reported step may lag the servers'; the exact step is read after
            # the pause, and an unchanged one skips the write.
            return True
        return step > state.last_checkpoint_step and bool(self.config.due(
            now=now, last_time=state.last_checkpoint_time, step=step,
            last_step=state.last_checkpoint_step))

    def check_pause_time(self, state: JobState, now: float) -> None:
        """Raise when the trainers have not all paused within the timeout."""
        if now - state.pause_started > self.timeout:
            raise TrainingTimeout(
                f"the trainers did not all pause for a checkpoint within timeout={self.timeout:g} "
                "s; check the workers' logs, or raise timeout=")

    async def write(self, engine: Engine, state: JobState | CheckpointTimes,
                    manifest: dict[str, Any], *, step: int,
                    generation: int, pause_s: float, version: int | None = None,
                    written: Callable[[], Awaitable[None]] | None = None,
                    ) -> dict[str, Any] | None:
        """Have the engine write its files, then write the manifest; None when the parameters
        were not finite, or when a holder wrote another ``version`` than the one given (its
        state moved on while it was written: the files are not the manifest's), and the last
        good checkpoint stays."""
        directory = self.store.directory(step, generation)
        t0 = time.perf_counter()
        records = await engine.save(
            directory=directory, paths=lambda index: self.store.shard_path(directory, index),
            metadata={"step": str(step)})
        if written is not None:
            # The holders' files are written and their counts taken: the trainers need not
            # wait for the manifest and the pruning (a copy every 5 s paused them for both).
            await written()
        state.last_checkpoint_time, state.last_checkpoint_step = time.time(), step
        if not all(r["finite"] for r in records):
            logger.warning("checkpoint at step %d skipped: the parameters are not finite", step)
            return None
        if version is not None and any(int(r["version"]) != version for r in records):
            logger.info("checkpoint at step %d skipped: its holder had moved on to step %s", step,
                        sorted({int(r["version"]) for r in records}))
            return None
        manifest = {
            # The holders' own counts, taken under their locks while every trainer is paused.
            **manifest, "step": min(int(r["version"]) for r in records),
            "samples": min(int(r["samples"]) for r in records), "generation": generation,
            "shards": [f"shard-{r['index']}.safetensors" for r in records if "sharded" not in r],
            "files": [{"index": r["index"], "start": r["start"], "stop": r["stop"]}
                      for r in records if "sharded" not in r],
            # A state every rank wrote its shard of (dt.run): the engine's record says where.
            **next(({"sharded": r["sharded"]} for r in records if "sharded" in r), {}),
        }
        loop = asyncio.get_running_loop()
        # File-system calls block: keep them off the event loop that carries the job's messages.
        await loop.run_in_executor(None, self.store.write_manifest, directory, manifest)
        await loop.run_in_executor(None, self.store.prune)
        info = {"directory": directory, "step": manifest["step"],
                "write_s": time.perf_counter() - t0, "pause_s": pause_s, "time": time.time()}
        logger.info("checkpoint %s written in %.3f s", directory, info["write_s"])
        return info

    def load(self, *, n_params: int, strategy: str) -> Restore | None:
        """The newest complete checkpoint, checked against this job; None when there is none."""
        newest = self.store.newest()
        if newest is None:
            return None
        directory, manifest = newest
        if int(manifest.get("n_params", -1)) != n_params:
            raise InvalidInput([
                f"the checkpoint {directory} holds {manifest.get('n_params')} parameters but the "
                f"model has {n_params}: resume with the model it was written for, or use another "
                "CheckpointConfig(path=...)."
            ])
        if manifest.get("strategy") != strategy:
            logger.info("resuming a %s checkpoint with strategy=%s", manifest.get("strategy"),
                        strategy)
        return Restore(directory, manifest, self.store)
