"""``dt.run``: the user's own training function on every rank, with the data, scores, stop
conditions, checkpoints and recovery a ``Trainer`` job has (one controller for both). Its
arguments become a :class:`~dask_train.api._run_job.RunJob` checked before any work;
:func:`run_job` then puts the data on the workers, places the ranks and drives
:class:`~dask_train.engines.run.engine.RunEngine` generations
(:func:`~dask_train.api._drive.drive`, as every job)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dask_train.api._drive import drive
from dask_train.api._job_result import job_fields
from dask_train.api._job_spec import build_spec
from dask_train.api._run_checks import pickled
from dask_train.api._run_job import RunJob
from dask_train.api._run_result import RunResult
from dask_train.api._run_sets import small_sets, streamed
from dask_train.api._run_wait import wait_for_workers
from dask_train.controller._controller import Outcome
from dask_train.controller._interrupt import interrupted_early
from dask_train.data._cluster import declared_resources
from dask_train.engines._registry import engine_entry
from dask_train.errors import InvalidInput, release_frames
from dask_train.policy._placement import Roles
from dask_train.runtime._roles import check_room, ensure_plugin, trainer_workers

if TYPE_CHECKING:
    from distributed import Client

    from dask_train.checkpoint import CheckpointConfig
    from dask_train.policy import Callback, FailureConfig, StopCondition


def run(fn: Callable[..., Any], *, data: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None, workers: int | tuple[int, int] | None = None,
        epochs: int | None = None, batch_size: int = 64, client: Client | None = None,
        stop: Sequence[StopCondition] = (), callbacks: Sequence[Callback] = (),
        checkpoint: CheckpointConfig | str | None = None, failure: FailureConfig | None = None,
        resume: bool = False, seed: int = 0, shuffle: bool = True, blocks_ahead: int | str = "auto",
        timeout: float = 120.0, device: str = "auto", data_mode: str = "auto",
        resources: Mapping[str, float] | None = None) -> RunResult:
    """Run ``fn(ctx, **config)`` on one rank per Dask worker, as one job.

    Parameters
    ----------
    fn : callable
        ``fn(ctx, **config)``: ``ctx`` is the rank's :class:`~dask_train.engines.run.context.
        RunContext`. Defined anywhere (a script, a notebook): it travels by value.
    data : dict, optional
        Named data sets: the first (``{"train": (X, y)}`` or ``X`` alone; dask or numpy arrays,
        DataFrames, dicts of them, or a Hugging Face ``datasets.Dataset``, its columns by name,
        read in blocks on the workers) is read with ``ctx.batches()``, each row once per epoch
        over the ranks; the others go whole to every rank (``ctx.dataset(name)``, 64 MiB at
        most).
    config : dict, optional
        Keyword arguments of ``fn`` (also ``ctx.config``).
    workers : int or (int, int), optional
        Ranks, one per Dask worker, or ``(least, most)``: what the cluster has (after a loss
        too). Default: every worker.
    epochs, batch_size : int, optional
        ``ctx.epochs()``'s and ``ctx.batches()``'s when the function does not say.
    client : distributed.Client, optional
        The cluster; by default the current client, or an embedded local cluster.
    stop, callbacks, checkpoint, failure
        As for :class:`~dask_train.Trainer`, on the reported metrics; a checkpoint is written at
        each ``ctx.report(checkpoint=...)`` (``every_seconds``/``every_steps`` do not apply).
    resume : bool
        Start from the newest checkpoint: ``ctx.restore()``, epochs and data position.
    seed, shuffle, blocks_ahead, data_mode
        Rows shuffled per epoch and block from ``seed`` (which seeds each rank's torch RNG too);
        blocks queued per rank ahead of its block ("auto" as a Trainer's); ``data_mode`` as ``fit(data=)``.
    timeout : float
        Longest wait for a rank (start, data, a report, the end), in seconds.
    device : {"auto", "cpu", "cuda"}
        ``ctx.device``: "auto" is the GPU when every worker has one (NCCL for the group).
    resources : dict, optional
        Dask worker resources each rank holds, ``{"GPU": 1}`` (as ``dask worker --resources
        GPU=1`` declares them): ranks run only on workers that declare them, a lost rank's
        worker is replaced only by one that does, and each rank's task holds them while it runs,
        so another job's ranks cannot share its worker. The data's tasks go where Dask puts
        them. Refused before any work, naming the workers with them, when fewer than the ranks
        (the least of ``(least, most)``, waited for up to ``timeout``) have them free.

    Returns
    -------
    RunResult

    Raises
    ------
    InvalidInput
        Every problem with the arguments, before anything is sent to the cluster.
    RoleFailed
        A rank's function raised: its exception and traceback are the cause.
    WorkerLost
        More workers were lost than ``failure.max_failures`` allows.

    Examples
    --------
    >>> def train(ctx, lr=1e-3):                                         # doctest: +SKIP
    ...     model = ctx.prepare(torch.nn.Linear(64, 10))
    ...     opt = torch.optim.Adam(model.parameters(), lr=lr)
    ...     for epoch in ctx.epochs(3):
    ...         for xb, yb in ctx.batches():
    ...             opt.zero_grad()
    ...             torch.nn.functional.cross_entropy(model(xb), yb).backward()
    ...             opt.step()
    ...         ctx.report({"loss": float(...)})
    >>> result = dt.run(train, data={"train": (X, y)}, config={"lr": 3e-3})  # doctest: +SKIP
    """
    clock = {"fit": time.time(), "connect": 0.0, "persist": 0.0}
    job = RunJob.of(fn, data=data, config=config, workers=workers, epochs=epochs,
                    batch_size=batch_size, stop=stop, callbacks=callbacks, checkpoint=checkpoint,
                    failure=failure, resume=resume, seed=seed, shuffle=shuffle,
                    blocks_ahead=blocks_ahead, timeout=timeout, device=device,
                    data_mode=data_mode, resources=resources)
    problems = job.problems()
    if problems:
        raise InvalidInput(problems)
    fn_blob, small = pickled(fn), small_sets(job.sets)
    client = _connected(client, clock, fn)
    try:
        return run_job(client, job, fn_blob=fn_blob, small=small, clock=clock)
    except KeyboardInterrupt as exc:  # before the controller ran: one line, no traceback
        release_frames(exc)
        raise interrupted_early(exc) from None
    except BaseException as exc:
        release_frames(exc)  # the job's futures, held by the frames below (see Trainer.fit)
        raise


def check_run(s: Mapping[str, Any]) -> list[str]:
    """Every problem with ``dt.run``'s keyword arguments ``s`` (``fn`` among them, the others
    :func:`run`'s defaults where left out; ``client``, which holds no setting, is left aside):
    nothing is sent anywhere. The CLI checks its job with it."""
    args = {name: p.default for name, p in inspect.signature(run).parameters.items()
            if p.default is not inspect.Parameter.empty}
    args.update(s)
    args.pop("client", None)
    return RunJob.of(**args).problems()


def _connected(client: Client | None, clock: dict[str, float], fn: Any) -> Client:
    """``client``, its scheduler and workers checked (once) before anything runs, or the
    default one; the seconds it took in ``clock["connect"]``. An embedded cluster started here
    has its workers start with torch and ``fn``'s imports (see ``runtime._fork``)."""
    from dask_train.runtime import default_client
    from dask_train.runtime._fork import function_imports
    from dask_train.runtime._versions import check_once

    t = time.time()
    client = check_once(client) if client is not None else \
        default_client(imports=["torch", *function_imports(fn)])
    clock["connect"] = time.time() - t
    return client


#: The ledger's epoch bound when the function alone says how many epochs it trains.
_UNBOUNDED_EPOCHS = 1_000_000_000


def run_job(client: Client, job: RunJob, *, fn_blob: bytes, small: dict[str, Any],
            clock: dict[str, float]) -> RunResult:
    """Run the checked ``dt.run`` job on ``client``'s cluster."""
    ensure_plugin(client)
    timeout = float(job.cluster.timeout)
    placement = job.cluster.placement
    least, most = job.cluster.bounds(len(trainer_workers(client, placement)))
    alive, asked = wait_for_workers(client, least, timeout=timeout, placement=placement)
    try:
        # Before the data moves: workers with the resources whose slots others hold now.
        check_room(client, placement, need=least, what=f"workers={job.cluster.workers!r}",
                   one_per_worker=True)
        return _run_on(client, job, alive, asked, least=least, most=most, timeout=timeout,
                       fn_blob=fn_blob, small=small, clock=clock)
    finally:
        if asked:  # not yet handed to the job's controller
            client.cancel(asked)


def _run_on(client: Client, job: RunJob, alive: dict[str, int], asked: list[Any], *,
            least: int, most: int, timeout: float, fn_blob: bytes, small: dict[str, Any],
            clock: dict[str, float]) -> RunResult:
    """:func:`run_job` once ``alive`` holds its least workers; ``asked``: the placeholders
    that asked for them (emptied once the controller holds them)."""
    from dask_train.engines.run.context import RunSettings
    from dask_train.runtime._devices import probe_devices

    placement = job.cluster.placement
    t = time.time()
    checkpoint = job.recovery.checkpoint_config()
    blocks, labels, train = streamed(client, job.sets, ranks=min(most, len(alive)),
                                     mode=str(job.data_mode), timeout=timeout,
                                     written=_written_rows(checkpoint) if job.resume else None)
    clock["persist"] = time.time() - t
    devices = probe_devices(client, str(job.cluster.device),
                            workers=trainer_workers(client, placement) if placement else None)
    # The engine's own part: what the user's function gets besides ctx's data.
    run = RunSettings(train=train, labels=labels, small=small,
                      checkpointing=checkpoint is not None, epochs=job.data.epochs,
                      batch_size=int(job.data.batch_size), sharded_root=_staging(checkpoint))
    spec = build_spec(job, strategy=engine_entry("run").strategy, workers=most,
                      most_workers=most, batch_size=int(job.data.batch_size),
                      epochs=int(job.data.epochs or _UNBOUNDED_EPOCHS), devices=devices,
                      run=run)
    user_config = dict(job.config or {})
    engine_cls = engine_entry("run").engine_class()

    def plan(alive: Mapping[str, int]) -> Roles:
        if placement:  # ranks only where the resources are (a replacement, a joiner too)
            alive = placement.usable_for(alive, declared_resources(client), need=least,
                                         what=f"workers={job.cluster.workers!r}")
        if len(alive) < least:
            raise InvalidInput([f"workers={job.cluster.workers!r}: only {len(alive)} Dask "
                                f"workers are left, fewer than the {least} the job needs; add "
                                "workers or lower the least number of ranks."])
        # One rank per worker process (torch's default group is one per process), in address
        # order so that a restart on the same workers gives each the same rank.
        return Roles({"trainer": sorted(alive)[:most], "ps": [], "scorer": []})

    def make_engine(roles: Roles, job_id: str, restore: Any) -> Any:
        return engine_cls(client, spec, roles, blocks, job=job_id, restore=restore,
                          fn_blob=fn_blob, run=run, user_config=user_config)

    settings = {"workers": job.cluster.workers, "epochs": job.data.epochs,
                "batch_size": job.data.batch_size, "seed": job.data.seed,
                "stop": list(job.stop), "resume": job.resume}
    return drive(client, spec, make_engine=make_engine, plan_roles=plan, roles=plan(alive),
                 rows=blocks.n_rows, params={**user_config, "run": settings},
                 resume=job.resume, placeholders=asked, release=blocks.release,
                 result=lambda outcome, wall_s: _result(outcome, wall_s=wall_s, clock=clock))


def _staging(config: Any) -> str:
    """Where the ranks write a sharded state before the controller moves it into a checkpoint:
    beside the checkpoints, so that the move is a rename on a local disk."""
    if config is None:
        return ""
    from dask_train.checkpoint import CheckpointStore
    from dask_train.checkpoint._io import StoragePath

    path = f"{CheckpointStore(config).path.rstrip('/')}/.staging"
    # The ranks open it with the checkpoint's storage options (credentials, an endpoint).
    return StoragePath(path, config.storage_options) if config.storage_options else path


def _written_rows(config: Any) -> list[int] | None:
    """The rows of each data block the newest checkpoint under ``config`` was written for (its
    ledger's blocks); None without one."""
    if config is None:
        return None
    from dask_train.checkpoint import CheckpointStore
    from dask_train.policy._ledger import written_rows

    newest = CheckpointStore(config).newest()
    ledger = None if newest is None else newest[1].get("ledger")
    return None if not ledger else written_rows(ledger)


def _result(outcome: Outcome, *, wall_s: float, clock: Mapping[str, float]) -> RunResult:
    ranks = sorted(outcome.ending.trainers, key=lambda r: r["trainer"])
    return RunResult(returns=[r.pop("returned", None) for r in ranks], ranks=ranks,
                     **job_fields(outcome, wall_s=wall_s, clock=clock))
