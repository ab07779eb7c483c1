"""A ``dt.run`` rank's own ``init_process_group`` and ``destroy_process_group``: code written
for torchrun calls both, and meets the group the job already made.

While a rank's function runs (:func:`job_group`), torch's two functions are replaced in
``torch.distributed`` (and its ``distributed_c10d`` module) by :func:`_init` and :func:`_destroy`:
an init that asks for the group the job made (any backend, ``env://`` or an explicit method,
the same world size and rank, or none given) returns it as it stands; a destroy of the default
group is left to the job's teardown, which still needs the group for the rank's last report and
its hand-back. A script that imported the functions by name before (``from torch.distributed
import init_process_group`` at the top of a module the worker had already loaded) keeps torch's
own: it then fails as it does today, with torch's "initialize the default process group twice".

The shims stay transparent outside a job (they call torch's own unless a rank is inside
:func:`job_group`), so a module that bound them by name while a job ran is unharmed afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
#: What the shims act on while a rank's function runs: the job's group was adopted, or the rank
#: runs alone and the function's own group is destroyed at its end (see :func:`job_group`).
_ACTIVE: dict[str, Any] = {"depth": 0, "job_made": False, "user_made": False, "where": ""}
_ORIGINAL: dict[str, Any] = {}


def _init(backend: str | None = None, init_method: str | None = None, timeout: Any = None,
          world_size: int = -1, rank: int = -1, store: Any = None, group_name: str = "",
          pg_options: Any = None, device_id: Any = None, **more: Any) -> None:
    import torch.distributed as dist

    original = _ORIGINAL["init_process_group"]
    if not _ACTIVE["depth"] or not dist.is_initialized() or not _ACTIVE["job_made"]:
        original(backend=backend, init_method=init_method, timeout=timeout,
                 world_size=world_size, rank=rank, store=store, group_name=group_name,
                 pg_options=pg_options, device_id=device_id, **more)
        if _ACTIVE["depth"]:
            _ACTIVE["user_made"] = True
        return
    have_world, have_rank = dist.get_world_size(), dist.get_rank()
    if world_size not in (-1, have_world) or rank not in (-1, have_rank):
        raise ValueError(
            f"init_process_group(world_size={world_size}, rank={rank}) on {_ACTIVE['where']}: "
            f"the job's process group is already made, with world size {have_world}, this rank "
            f"{have_rank}; call it without world_size= and rank= (torchrun code passes them from "
            "WORLD_SIZE and RANK, which dt.run sets), or run fewer ranks (workers=).")
    have_backend = dist.get_backend()
    if backend is not None and str(backend).split(":")[0].lower() not in \
            str(have_backend).lower():
        logger.info("init_process_group(backend=%r) on %s: the job's group uses %s and is kept",
                    backend, _ACTIVE["where"], have_backend)


def _destroy(group: Any = None) -> None:
    import torch.distributed as dist

    original = _ORIGINAL["destroy_process_group"]
    default = group is None or group is dist.GroupMember.WORLD
    if _ACTIVE["depth"] and _ACTIVE["job_made"] and default:
        # The job's own teardown destroys it, after the rank's last report.
        return
    original(group)
    if default and _ACTIVE["depth"]:
        _ACTIVE["user_made"] = False


def torch_own(name: str) -> Any:
    """torch's own ``init_process_group`` or ``destroy_process_group`` (``name``), never the
    shims: dask-train's own start and teardown of a group (a ``dt.run`` job regrouping at a
    report, inside a rank's function) must make and destroy it for real; through the shim the
    destroy did nothing, and the next group met "a torch default process group that dask-train
    did not start"."""
    import torch.distributed.distributed_c10d as c10d

    return _ORIGINAL.get(name) or getattr(c10d, name)


@contextlib.contextmanager
def job_group(*, job_made: bool, where: str) -> Iterator[None]:
    """Within: the rank's function's ``init_process_group``/``destroy_process_group`` meet the
    job's group (``job_made``: one was started for the job); a group the function made itself
    (a rank running alone) is destroyed at the end if it did not do so. ``where`` names the
    rank in errors ("rank 1 on tcp://...")."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    with _LOCK:
        if not _ORIGINAL:
            _ORIGINAL.update(init_process_group=c10d.init_process_group,
                             destroy_process_group=c10d.destroy_process_group)
        if _ACTIVE["depth"] == 0:
            for module in (dist, c10d):
                setattr(module, "init_process_group", _init)  # noqa: B010 - a module's global
                setattr(module, "destroy_process_group", _destroy)  # noqa: B010
        _ACTIVE["depth"] += 1
        _ACTIVE.update(job_made=job_made, user_made=False, where=where)
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE["depth"] -= 1
            made = _ACTIVE["user_made"]
            _ACTIVE["user_made"] = False
            if _ACTIVE["depth"] == 0:
                for module in (dist, c10d):
                    setattr(module, "init_process_group", _ORIGINAL["init_process_group"])  # noqa: B010
                    setattr(module, "destroy_process_group",  # noqa: B010
                            _ORIGINAL["destroy_process_group"])
            if made and dist.is_initialized():
                # The function's own group (it ran alone, with no group of the job): the
                # worker is left as it was found.
                _ORIGINAL["destroy_process_group"]()
