"""Running a job across failures: lost roles go to the failure policy, restarts are generations.

``run_job`` runs generation after generation until one ends normally. Within a generation,
``check_roles`` runs every second: a lost or failed role becomes a :class:`Failure`, the pure
:func:`decide` turns the job's status into an action, and this module carries it out:

* CONTINUE (async trainer lost): the ledger moves its unconsumed rows to the survivors, with the
  rows the servers already applied skipped, so no sample of the epoch is lost or doubled;
* REPLACE (scorer): a new scorer on another live worker;
* RESTART (parameter server, sync rank, last trainer): the generation is torn down and a new one
  is placed on the live workers (a restarted or newly joined worker included) and starts from
  the newest checkpoint;
* RAISE: a typed error naming the worker, the role and the cause.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

import numpy as np
from distributed import Client
from distributed.comm import CommClosedError

from dask_train.controller._checkpointing import Restore, load_restore
from dask_train.controller._controller import JobLog, JobSpec, _Controller
from dask_train.data._blocks import BlockSet
from dask_train.engines import _worker as _state
from dask_train.errors import TrainingTimeout
from dask_train.policy._failure import Action, Failure, JobStatus, decide, failure_error
from dask_train.policy._placement import Roles, plan_roles

logger = logging.getLogger(__name__)


class _Restart(Exception):
    """Internal: the current generation must end and a new one start from a checkpoint."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.cause)
        self.failure = failure


async def _alive(client: Client) -> dict[str, int]:
    """Live Dask workers and their thread counts."""
    info = (await client.scheduler.identity()).get("workers", {})
    return {addr: int(w.get("nthreads", 1)) for addr, w in info.items()}


async def check_roles(ctl: _Controller) -> None:
    """Find lost or failed roles and act on each as the failure policy decides."""
    alive = await _alive(ctl.client)
    failures: list[Failure] = []
    for kind in ("ps", "worker", "scorer"):
        for i, address in enumerate(ctl.roles[kind]):
            if kind == "worker" and i in ctl.retired:
                continue
            if kind == "ps" and ctl.spec.strategy == "sync":
                continue
            if address not in alive:
                failures.append(Failure(kind, i, address, f"the Dask worker {address} left the cluster"))
    for failure in failures:
        await _handle(ctl, failure, alive)
    if failures:
        return
    if ctl.spec.strategy != "sync" and not ctl.stopped_by:
        _adopt_new_workers(ctl, alive)
    # Roles that raised on a live worker: the scorer is replaced; a trainer's error is the
    # user's (model, data) and ends the job, unless its connection broke because a peer died.
    scorer = ctl.scorer_future
    if scorer is not None and scorer.status == "error":
        exc = await scorer.exception()
        await _handle(ctl, Failure("scorer", 0, ctl.roles["scorer"][0],
                                   f"the scorer raised {type(exc).__name__}: {exc}"), alive)
        return
    for i in ctl.live_trainers():
        fut = ctl.trainer_futures[i]
        if fut.status == "error":
            exc = await fut.exception()
            if isinstance(exc, (OSError, CommClosedError, TrainingTimeout)):
                # Usually a peer's worker died (a server, a rank): wait for the scheduler to
                # notice, so the root cause is what the policy sees.
                for _ in range(20):
                    await asyncio.sleep(0.1)
                    if set(ctl.roles.addresses) - set(await _alive(ctl.client)):
                        return await check_roles(ctl)
            await ctl.raise_role_error(fut, f"trainer worker-{i} on {ctl.roles['worker'][i]}")
    for _trainer, fut in ctl.feeds:
        if fut.status == "error":
            await ctl.raise_role_error(fut, f"feeding block task {fut.key}")
    ctl.feeds = [(t, f) for t, f in ctl.feeds if f.status != "finished"]


def _adopt_new_workers(ctl: _Controller, alive: dict[str, int]) -> None:
    """Async: a worker that joined (a restarted one too) gets a trainer, up to ``workers``."""
    live = ctl.live_trainers()
    if len(live) >= ctl.spec.workers or all(ctl.ended[i] or ctl.idle[i] for i in live):
        return
    # Workers without a live trainer (a replaced scorer may already run on a new worker).
    used = {ctl.roles["worker"][i] for i in live}
    for address in [a for a in sorted(alive) if a not in used][: ctl.spec.workers - len(live)]:
        ctl.add_trainer(address)


async def _handle(ctl: _Controller, failure: Failure, alive: dict[str, int]) -> None:
    log = ctl.log
    live_trainers = [i for i in ctl.live_trainers()
                     if not (failure.kind == "worker" and i == failure.index)
                     and ctl.roles["worker"][i] in alive]
    status = JobStatus(
        strategy=ctl.spec.strategy, failure=failure, failures=len(log.failures) + 1,
        live_trainers=len(live_trainers), live_workers=len(alive),
        has_checkpoint=bool(log.checkpoints) or ctl.restore is not None,
    )
    decision = decide(status, ctl.spec.failure)
    log.failures.append({
        "time_s": ctl.elapsed(), "role": f"{failure.kind}-{failure.index}", "worker": failure.worker,
        "cause": failure.cause, "action": decision.action.value, "reason": decision.reason,
        "generation": ctl.generation,
    })
    logger.warning("%s-%d on %s: %s -> %s (%s)", failure.kind, failure.index, failure.worker,
                   failure.cause, decision.action.value, decision.reason)
    if decision.action is Action.RAISE:
        raise failure_error(status, decision)
    if decision.action is Action.RESTART:
        raise _Restart(failure)
    if decision.action is Action.REPLACE:
        await _replace_scorer(ctl, alive)
    else:
        await _retire_trainer(ctl, failure.index)


async def _retire_trainer(ctl: _Controller, index: int) -> None:
    """Move a lost trainer's unconsumed rows to the survivors."""
    ref = ctl.shards[0]
    positions = await ctl.client.run(_state.shard_positions, ctl.job, ref.index, index,
                                     workers=[ref.address], asynchronous=True)
    # The rows the servers applied from the blocks the trainer was reading when it died.
    applied = {(int(e), int(b)): int(rows) for e, b, rows in positions.get(ref.address, [])}
    moved = ctl.ledger.retire(index, applied)
    ctl.retired.add(index)
    stale = [f for t, f in ctl.feeds if t == index and f.status == "pending"]
    stale += [ctl.trainer_futures[index]]
    await ctl.client.cancel(stale, asynchronous=True)
    ctl.feeds = [(t, f) for t, f in ctl.feeds if t != index]
    logger.warning("trainer %d retired; %d blocks moved to the survivors", index, len(moved))
    ctl.regrant_idle()


async def _replace_scorer(ctl: _Controller, alive: dict[str, int]) -> None:
    old = ctl.scorer_future
    if old is not None and old.status == "pending":
        await ctl.client.cancel([old], asynchronous=True)
    used = {a: 0.0 for a in alive}
    for kind, weight in (("worker", 1.0), ("ps", 0.5)):
        for address in ctl.roles[kind]:
            if address in used:
                used[address] += weight
    address = min(sorted(used), key=lambda a: used[a])
    ctl.scorer_restarts += 1
    await ctl.start_scorer(address)


async def _plan(client: Client, spec: JobSpec, before: int) -> Roles:
    """Roles for a new generation on the live workers.

    Waits a little (at most 10 s) for the cluster to get back to ``before`` workers: a nanny
    restarts a killed worker in about a second, and the new generation should use it.
    """
    deadline = time.monotonic() + min(10.0, spec.timeout)
    alive = await _alive(client)
    while len(alive) < before and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        alive = await _alive(client)
    workers = min(spec.workers, len(alive)) if spec.strategy == "sync" else spec.workers
    ps = 0 if spec.strategy == "sync" else spec.ps
    return Roles(plan_roles(alive, ps=ps, worker=workers, scorer=spec.scorer))


async def _start_group(client: Client, spec: JobSpec, roles: Roles) -> Any:
    if spec.strategy != "sync":
        return None
    from dask_train.runtime._torch_group import start_torch

    # start_torch is the blocking API: run it in a thread so this loop keeps serving it.
    call = functools.partial(start_torch, client, workers=roles["worker"], backend="gloo",
                             timeout=spec.timeout)
    return await asyncio.get_running_loop().run_in_executor(None, call)


async def _close_group(group: Any) -> None:
    if group is None:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(None, group.close)
    except Exception:  # ranks on a dead worker cannot be closed; the others were
        logger.info("closing the torch group after a failure", exc_info=True)


async def run_job(
    client: Client, spec: JobSpec, roles: Roles, blocks: BlockSet, validation: Any, progress: Any,
    *, resume: bool = False,
) -> tuple[_Controller, dict[str, Any] | None, list[dict[str, Any]], tuple[np.ndarray, int, int]]:
    """Run a job to its end, across as many generations as failures need; always cleans up."""
    log = JobLog()
    restore: Restore | None = None
    if resume and spec.checkpoint is not None:
        from dask_train.checkpoint import CheckpointStore

        store = CheckpointStore(spec.checkpoint)
        restore = load_restore(store, n_params=spec.n_params, strategy=spec.strategy)
        if restore is not None:
            _restore_log(log, spec, restore)
    generation = 0
    while True:
        group = await _start_group(client, spec, roles)
        ctl = _Controller(client, spec, roles, blocks, validation, log=log, generation=generation,
                          restore=restore)
        ctl.progress = progress
        log.generations = generation + 1
        try:
            await ctl.start()
            await ctl.run(check_roles)
            final, trainers = await ctl.finish()
            params = await ctl.pull_parameters()
            await ctl.final_checkpoint(trainers, params[1], params[2])
        except _Restart:
            t0 = time.time()
            before = len(set(ctl.roles.addresses) | set(await _alive(client)))
            await _end_generation(ctl, spec, group)
            assert spec.checkpoint is not None
            from dask_train.checkpoint import CheckpointStore

            restore = load_restore(CheckpointStore(spec.checkpoint), n_params=spec.n_params,
                                   strategy=spec.strategy)
            roles = await _plan(client, spec, before)
            generation += 1
            logger.warning("generation %d starts from %s on %s (%.2f s after the failure)", generation,
                           restore.directory if restore else None, roles, time.time() - t0)
            continue
        except BaseException:
            await _end_generation(ctl, spec, group)
            raise
        await _end_generation(ctl, spec, group)
        if final is not None and final["params"] is None:
            ctl.on_score(final["record"])  # the final parameters' score closes the history
        return ctl, final, trainers, params


async def _end_generation(ctl: _Controller, spec: JobSpec, group: Any) -> None:
    try:
        await asyncio.wait_for(ctl.cleanup(), timeout=spec.timeout)
    except Exception:  # cleanup must not hide the job's own error
        logger.exception("cleaning up job %s failed", ctl.job)
    await _close_group(group)


def _restore_log(log: JobLog, spec: JobSpec, restore: Restore) -> None:
    """Continue the history, the clock and the stop conditions of a resumed job."""
    manifest = restore.manifest
    log.records.extend(manifest.get("records") or [])
    log.elapsed_before = float(manifest.get("elapsed_s", 0.0))
    saved = manifest.get("stop") or []
    for condition, state in zip(spec.stop, saved):
        if state.get("type") == type(condition).__name__:
            condition.load_state_dict(state.get("state") or {})
