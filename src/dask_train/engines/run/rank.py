"""Worker side of ``dt.run``: one rank's task runs the user's function with its
:class:`~.context.RunContext`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import cloudpickle

from dask_train.engines._spec import RoleConfig
from dask_train.engines.harness.role import TrainerRole, role_task
from dask_train.engines.run.context import RunContext, RunSettings
from dask_train.runtime._adopt import job_group
from dask_train.runtime._hosts import split_endpoint, worker_host
from dask_train.runtime._ports import free_port
from dask_train.runtime._torch_rank import rank_device


@role_task
def run_user_rank(
    fn_blob: bytes,
    *,
    job: str,
    index: int,
    config: RoleConfig,
    run: RunSettings,
    user_config: Mapping[str, Any],
) -> dict[str, Any]:
    """Dask task: rank ``index`` of a ``dt.run`` job; its function's return value in
    ``"returned"`` beside the rank's counts."""
    import torch.distributed as dist

    role = TrainerRole(job=job, index=index, config=config, kind="rank")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1 and dist.get_rank() != index:
        raise RuntimeError(f"rank {index} on {role.address} found the process group of rank "
                           f"{dist.get_rank()}: the job's group was not started here")
    local_rank = run.local_ranks[index] if index < len(run.local_ranks) else 0
    # As torchrun sets them: libraries that read them (Lightning, accelerate) and the function's
    # own init_process_group (env://) find the job's group.
    if run.master:
        host, port = split_endpoint(run.master)
    else:  # a rank alone, with no group of the job: its function's own init finds one
        host = worker_host(role.address)
        port = free_port(host)
    torchrun_env = {"RANK": str(index), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
                    "MASTER_ADDR": host, "MASTER_PORT": str(port)}
    before = {name: os.environ.get(name) for name in torchrun_env}
    os.environ.update(torchrun_env)
    try:
        with job_group(job_made=dist.is_initialized(), where=f"rank {index} on {role.address}"):
            return _run_fn(fn_blob, role=role, run=run, config=config, user_config=user_config,
                           index=index, world=world, local_rank=local_rank)
    finally:
        for name, value in before.items():  # the worker as it was for the tasks after the job
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run_fn(fn_blob: bytes, *, role: TrainerRole, run: RunSettings, config: RoleConfig,
            user_config: Mapping[str, Any], index: int, world: int,
            local_rank: int) -> dict[str, Any]:
    """The user's function on this rank, inside the job's group (see :func:`run_user_rank`)."""
    import torch

    _forget_accelerate_state()
    device = torch.device(rank_device(config.device_kind, config.device_for(role.address)) or "cpu")
    restore = _restore_info(config.restore)
    ctx = RunContext(role, run=run, config=user_config, world_size=world, local_rank=local_rank,
                     device=device, restore=restore)
    fn = cloudpickle.loads(fn_blob)
    try:
        returned = fn(ctx, **dict(user_config))
    except Exception as exc:
        from dask_train.runtime._torch_group import _collateral

        if not _collateral(exc):
            ctx.abort()
            raise
        ctx.close()
        # The user's objects (a DDP model and, through it, the process group) go with the
        # exception's frames and the context: freed here, a gloo group whose peer vanished can
        # block its destructor forever (it joins a thread stuck on that peer), and with it this
        # Dask thread. They are let go on a thread of their own instead.
        _release_elsewhere(exc, ctx)
        # A peer's worker died under a collective: the controller restarts the generation, and
        # raising would only print this rank's side of it as an ERROR in its worker's log.
        return {"trainer": index, "lost_peer": f"{type(exc).__name__}: {exc}"}
    ctx.close()
    role.exit(steps=ctx.step)
    cursor = ctx._cursor
    return {**role.result(steps=ctx.step, samples=0 if cursor is None else cursor.samples,
                          feed_wait_s=0.0 if cursor is None else cursor.reader.wait_s),
            "returned": returned}


def _forget_accelerate_state() -> None:
    """Make accelerate read this rank's group afresh (an earlier job in this worker process, or
    the generation before a restart, left its ranks in accelerate's process-wide state, which
    ``TrainingArguments`` and ``Accelerator`` would otherwise reuse). Nothing when accelerate was
    never imported here."""
    import sys

    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


def _release_elsewhere(*objects: Any) -> None:
    """Drop the last references to ``objects`` on a daemon thread, a moment from now."""
    import threading
    import time

    held = list(objects)

    def drop() -> None:
        time.sleep(2.0)  # after the task's own frame let go of them
        held.clear()

    threading.Thread(target=drop, name="dask-train-release", daemon=True).start()


def _restore_info(restore: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The checkpoint a rank starts from, with the epoch its report was made in."""
    if restore is not None and restore.get("sharded"):
        return {**restore, "next_epoch": int(restore["sharded"].get("next_epoch", 0))}
    if restore is None or not restore.get("files"):
        return None
    from dask_train.checkpoint import load_metadata

    meta = load_metadata(restore["files"][0]["path"])
    return {**restore, "next_epoch": int(meta.get("next_epoch", "0"))}
