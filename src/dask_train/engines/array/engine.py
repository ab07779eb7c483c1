"""The numpy sync engine: an :class:`~dask_train.models.ArrayModel` trained with Dask alone.

The chief (this engine, on the client's event loop) holds the parameters and a torch optimizer
over them. Per step it sends the parameters once, runs one task per group of co-located blocks
(:func:`~dask_train.engines.array.worker.group_step`, where the blocks live, so no block moves),
adds the partial ``(loss_sum, grad_sum, rows)`` on the workers with a tree reduction, divides by
the rows (the exact mean gradient over the union of the groups' batches) and steps. A scoring
task runs in the background every ``score_every`` seconds.

Behind the same :class:`~dask_train.engines._protocol.Engine` protocol as the torch engines, so the
one controller gives it checkpoints (its parameters and optimizer state, and its position: epoch
and step within it), exact resume, a timeout on every wait, a replaced scorer, and a new
generation from the newest checkpoint when a step fails because a worker was lost.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from distributed import Client, Future

from dask_train.checkpoint import read_slice
from dask_train.data import BlockSet
from dask_train.engines._events import Epochs, NonFinite, Started
from dask_train.engines._protocol import Emit, Ending, Engine, Snapshot
from dask_train.engines._spec import JobSpec
from dask_train.engines.array.worker import group_step, score_task
from dask_train.engines.holders.optim import FlatOptimizer
from dask_train.engines.scoring.keeper import ScoreKeeper, score_event
from dask_train.errors import TrainingTimeout
from dask_train.policy._failure import Failure
from dask_train.policy._placement import Roles
from dask_train.runtime._cluster_view import ClusterView
from dask_train.runtime._reduce import EMBED_PARAMS_BYTES, add_terms, tree_reduce

logger = logging.getLogger(__name__)



class ArrayEngine(Engine):
    """One generation of numpy sync training (see the module docstring).

    Parameters
    ----------
    client : distributed.Client
    spec : JobSpec
        ``spec.train.module`` is the :class:`~dask_train.models.ArrayModel`.
    data : BlockSet
        The training blocks, persisted where they will stay.
    validation : (numpy.ndarray, numpy.ndarray) or None
    job : str
    restore : mapping, optional
        ``{"files", "step", "samples", "ledger"}`` of the checkpoint to start from.
    split_every : int
        Fan-in of the tree reduction.
    """

    strategy = "sync"

    def __init__(self, client: Client, spec: JobSpec, data: BlockSet, validation: Any, *,
                 job: str, restore: Mapping[str, Any] | None = None, split_every: int = 2) -> None:
        self.client, self.spec, self.data, self.validation = client, spec, data, validation
        assert spec.train is not None, "the numpy engine trains the spec's ArrayModel"
        self.train = spec.train
        self.model, self.job, self.split_every = spec.train.module, job, split_every
        # A resumed run keeps the checkpoint's groups, wherever their blocks live now (Dask moves
        # a block to its group's task if need be): a group's rows and their order are its own.
        saved = (restore or {}).get("ledger", {}).get("groups")
        self.groups = [list(g) for g in saved] if saved else data.groups()
        self.group_rows = [sum(data.rows[i] for i in g) for g in self.groups]
        self.rows_per_step = spec.batch_size * self.train.grad_accumulation
        self.steps_per_epoch = max(math.ceil(r / self.rows_per_step) for r in self.group_rows)
        self.opt = FlatOptimizer(torch.from_numpy(np.array(self.model.params, dtype=np.float64)),
                                 self.train.optim, max_step=spec.max_step)
        self.epoch, self.next_step, self.epochs_done = 0, 0, 0
        self.ledger: list[dict[str, Any]] = []
        if restore is not None:
            state = read_slice(restore["files"], 0, self.opt.param.numel())
            self.opt.restore(state, version=restore["step"], samples=restore["samples"])
            position = restore["ledger"]
            self.epoch, self.next_step = int(position["epoch"]), int(position["step"])
            self.epochs_done, self.ledger = int(position["epochs_done"]), list(position["records"])
        self.roles = Roles({"trainer": [data.holders[g[0]] for g in self.groups], "ps": [],
                            "scorer": []})
        self.emit: Emit = lambda event: None
        self.loop_task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None
        self.done = False
        self.stopping = False
        self.pause_id = 0  # requested
        self.parked_id = 0  # taken: the loop waits between two steps
        self.resumed = asyncio.Event()
        self.val_ref: Any = None
        self.scoring: tuple[Future, int, int] | None = None  # (future, step, samples)
        self.scored = ScoreKeeper()  # the last scored parameter sets
        self.last_score = 0.0

    # -- starting and the step loop ---------------------------------------------------------------
    async def start(self, emit: Emit) -> None:
        """Place the validation data on a worker and start the step loop."""
        self.emit = emit
        if self.validation is not None and self.train.scorer:
            await self._place_validation(sorted(self.data.holders)[-1])
        self.last_score = time.monotonic()
        self.loop_task = asyncio.get_running_loop().create_task(self._train())

    async def _place_validation(self, address: str) -> None:
        # One object, not one future per array: the scoring task takes the pair together.
        [self.val_ref] = await self.client.scatter([self.validation], workers=[address],
                                                   hash=False, direct=True, asynchronous=True)
        self.roles = self.roles.replace("scorer", [address])

    async def _train(self) -> None:
        try:
            while self.epoch < self.spec.epochs and not self.stopping:
                consumed = [min(r, self.next_step * self.rows_per_step) for r in self.group_rows]
                while self.next_step < self.steps_per_epoch and not self.stopping:
                    await self._maybe_park()
                    if self.stopping:
                        break
                    at_limit = await self._step(consumed)
                    if self.next_step == 0:
                        self.emit(Started(trainer=-1))
                    self.next_step += 1
                    await self._poll_score()
                    if at_limit:
                        self.stopping = True
                self.ledger += [{"epoch": self.epoch, "trainer": g, "rows": self.group_rows[g],
                                 "consumed": consumed[g]} for g in range(len(self.groups))]
                if self.next_step < self.steps_per_epoch:
                    break
                self.epoch, self.next_step = self.epoch + 1, 0
                self.epochs_done += 1
                self.emit(Epochs(completed=self.epochs_done))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a lost worker's blocks, a timeout: the controller decides
            self.error = exc
        finally:
            self.done = True

    async def _maybe_park(self) -> None:
        if self.pause_id > self.parked_id:
            self.parked_id = self.pause_id
            self.resumed.clear()
            await self.resumed.wait()

    async def _step(self, consumed: list[int]) -> bool:
        """One update; True once the step limit is reached."""
        params = self.opt.param.detach().numpy().copy()  # the optimizer changes it in place
        ref: Any = params
        if params.nbytes * len(self.groups) > EMBED_PARAMS_BYTES:
            # direct=True: from the client straight to a worker (see runtime._reduce.send_params).
            ref = await self.client.scatter(params, hash=False, direct=True, asynchronous=True)
        s, spec = self.next_step, self.spec
        parts = [
            self.client.submit(group_step, self.model.loss_grad, ref,
                               (spec.seed, self.epoch, s, self.rows_per_step, g, int(spec.shuffle)),
                               *[self.data.futures[i] for i in group], pure=False)
            for g, group in enumerate(self.groups)
        ]
        if len(parts) > self.split_every:
            parts = [tree_reduce(parts, add_terms, self.split_every, client=self.client)]
        try:
            results = await asyncio.wait_for(
                self.client.gather(parts, direct=True, asynchronous=True), self.spec.timeout)
        except asyncio.TimeoutError:
            raise TrainingTimeout(
                f"step {self.opt.version} took longer than timeout={self.spec.timeout:g} s; check "
                "that the workers holding the blocks are alive, or raise timeout=") from None
        loss, grad, rows = functools.reduce(add_terms, results)
        for g, group_rows in enumerate(self.group_rows):
            consumed[g] = min(group_rows, (s + 1) * self.rows_per_step)
        if not (math.isfinite(loss) and np.isfinite(grad).all()):
            self.emit(NonFinite(trainer=-1, loss=str(loss), step=self.opt.version,
                                epoch=self.epoch, block=-1))
            self.stopping = self.stopping or self.spec.on_nan == "stop"
            return False
        self.opt.grad.copy_(torch.from_numpy(grad / rows))
        return self.opt.step(int(rows))

    async def _poll_score(self, *, force: bool = False) -> None:
        """Publish a finished score; start the next one when due."""
        if self.scoring is not None and self.scoring[0].done():
            future, step, samples = self.scoring
            self.scoring = None
            if future.status == "finished":
                self.emit(score_event(step=step, samples=samples, scores=await future))
        now = time.monotonic()
        if self.val_ref is None or self.scoring is not None or \
                (not force and now - self.last_score < self.train.score_every):
            return
        self.last_score = now
        params = self.opt.param.detach().numpy().copy()
        self.scored.keep_snapshot(self.opt.version, params)
        future = self.client.submit(score_task, self.model.loss_grad, self.model.predict,
                                    params, self.val_ref, pure=False)
        self.scoring = (future, self.opt.version, self.opt.samples)

    # -- what the controller reads ----------------------------------------------------------------
    async def tick(self, now: float) -> str:
        """The reason the loop ended on its own, once it has."""
        await self._poll_score()
        return "trainers ended" if self.done and self.error is None else ""

    def epochs_completed(self) -> int:
        """Epochs fully stepped through."""
        return self.epochs_done

    def reported_step(self) -> int:
        """The optimizer's step count."""
        return self.opt.version

    def ledger_records(self) -> list[dict[str, Any]]:
        """One row per (epoch, group): the group's rows and how many were consumed."""
        return list(self.ledger)

    def ledger_state(self) -> dict[str, Any]:
        """The position: epoch and step within it, epochs done, the ledger so far."""
        return {"epoch": self.epoch, "step": self.next_step, "epochs_done": self.epochs_done,
                "records": list(self.ledger), "groups": self.groups}

    def live_trainers(self) -> int:
        """Groups of blocks (the chief needs every one)."""
        return len(self.groups)

    async def failures(self, view: ClusterView) -> list[Failure]:
        """A step that failed (usually a worker lost with its blocks), or a lost scorer worker
        (``view``: the controller's listing of this pass)."""
        alive = view.workers
        if self.error is not None:
            gone = [a for a in self.roles["trainer"] if a not in alive]
            worker = gone[0] if gone else (self.roles["trainer"] or ["?"])[0]
            cause = f"a step failed: {type(self.error).__name__}: {self.error}"
            self.error = None
            if not gone:
                raise RuntimeError(cause)  # not a lost worker: the user's model or data
            return [Failure("trainer", self.roles["trainer"].index(worker), worker, cause)]
        scorer = self.roles["scorer"]
        if scorer and scorer[0] not in alive:
            return [Failure("scorer", 0, scorer[0], f"the Dask worker {scorer[0]} left")]
        return []

    async def replace_scorer(self, alive: Mapping[str, int]) -> None:
        """Scatter the validation data to another live worker."""
        self.scoring = None
        await self._place_validation(sorted(alive)[0])

    # -- checkpoints ------------------------------------------------------------------------------
    def running(self) -> bool:
        """True while the step loop runs."""
        return not self.done

    async def pause(self, pause_id: int) -> None:
        """The loop parks before its next step."""
        self.pause_id = pause_id

    def paused(self, pause_id: int) -> Snapshot | None:
        """The position once the loop is parked."""
        if self.parked_id < pause_id:
            return None
        return Snapshot(step=self.opt.version, ledger=self.ledger_state())

    async def resume(self, pause_id: int) -> None:
        """Let the loop go on."""
        self.resumed.set()

    async def save(self, *, directory: str, paths: Callable[[int], str],
                   metadata: Mapping[str, str]) -> list[dict[str, Any]]:
        """Write the parameters and optimizer state from the client (the chief holds them)."""
        n = self.opt.param.numel()
        loop = asyncio.get_running_loop()
        meta = {**metadata, "start": "0", "stop": str(n)}
        saved = await loop.run_in_executor(None, functools.partial(
            self.opt.save, paths(0), metadata=meta))
        return [{**saved, "index": 0, "start": 0, "stop": n}]

    # -- ending -----------------------------------------------------------------------------------
    async def stop(self, *, keep_step: int | None) -> Ending:
        """Stop the loop; the final score; the parameters (the scored ones for ``keep_step``)."""
        self.stopping = True
        self.resumed.set()
        if self.loop_task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.loop_task), self.spec.timeout)
            except asyncio.TimeoutError:
                self.loop_task.cancel()
        final = await self._final_score(keep_step)
        params = self.opt.param.detach().numpy().copy()
        trainers = [{"trainer": g, "worker": self.roles["trainer"][g], "rows": self.group_rows[g],
                     "steps": self.opt.version} for g in range(len(self.groups))]
        return Ending(params=params, steps=self.opt.version, samples=self.opt.samples,
                      trainers=trainers, final=final)

    async def _final_score(self, keep_step: int | None) -> dict[str, Any] | None:
        if self.scoring is not None:  # the score in flight is part of the history
            try:
                await asyncio.wait_for(self.scoring[0], self.spec.timeout)
            except Exception:
                logger.warning("the last score of job %s did not arrive", self.job)
            await self._poll_score_done()
        if keep_step is not None and keep_step in self.scored:
            return {"record": None, "params": self.scored.get(keep_step)}
        if self.val_ref is None or self.opt.version in self.scored:
            return None  # the final parameters were scored already
        future = self.client.submit(score_task, self.model.loss_grad, self.model.predict,
                                    self.opt.param.detach().numpy().copy(), self.val_ref,
                                    pure=False)
        scores = await asyncio.wait_for(future, self.spec.timeout)
        return {"record": score_event(step=self.opt.version, samples=self.opt.samples,
                                      scores=scores), "params": None}

    async def _poll_score_done(self) -> None:
        last, self.last_score = self.last_score, math.inf  # publish, never start another
        await self._poll_score()
        self.last_score = last

    async def close(self) -> None:
        """Stop the loop and drop the scoring state (the blocks are the Trainer's to release)."""
        self.stopping = True
        self.resumed.set()
        if self.loop_task is not None and not self.loop_task.done():
            self.loop_task.cancel()
        if self.scoring is not None:
            self.scoring[0].release()
        self.scoring, self.val_ref = None, None
