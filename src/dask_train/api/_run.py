"""``dt.run``: the user's own training function on every rank, with the data, scores, stop
conditions, checkpoints and recovery a ``Trainer`` job has (one controller for both). Its
arguments become a :class:`RunJob` checked before any work; :func:`run_job` then puts the data
on the workers, places the ranks and drives :class:`~dask_train.engines.run.engine.RunEngine`
generations."""

from __future__ import annotations

import inspect
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dask_train.api._job_result import job_fields
from dask_train.api._run_result import RunResult
from dask_train.api._settings import RecoverySettings
from dask_train.controller._controller import Controller, Outcome
from dask_train.controller._interrupt import interrupted_early
from dask_train.controller._wanted import placeholder, weigh_placeholders
from dask_train.data._blocks import BlockSet
from dask_train.data._cluster import declared_resources
from dask_train.data._hf_datasets import as_arrays, kind_of
from dask_train.data._inputs import is_lazy, writable
from dask_train.data._training import TrainingData
from dask_train.engines._registry import engine_entry
from dask_train.engines._spec import JobSpec
from dask_train.errors import InvalidInput, release_frames
from dask_train.policy._placement import Placement, Roles
from dask_train.policy._scope import current_scope
from dask_train.policy._settings import (
    ClusterSettings,
    DataSettings,
    callback_problems,
    stop_problems,
)
from dask_train.policy.callbacks import run_callbacks
from dask_train.runtime._roles import check_room, ensure_plugin, trainer_workers

if TYPE_CHECKING:
    from distributed import Client

    from dask_train.checkpoint import CheckpointConfig
    from dask_train.policy import Callback, FailureConfig, StopCondition

logger = logging.getLogger(__name__)

#: Named data sets besides the streamed one go to every rank whole, inside its task, up to this.
SMALL_BYTES = 64 << 20


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
    settings = {k: v for k, v in locals().items() if k not in ("clock", "client")}
    job = RunJob.of(settings)
    problems = job.problems()
    if problems:
        raise InvalidInput(problems)
    fn_blob, small = _pickled(fn), _small_sets(job.sets)
    client = _connected(client, clock, fn)
    try:
        return run_job(client, job, fn_blob=fn_blob, small=small, clock=clock)
    except KeyboardInterrupt as exc:  # before the controller ran: one line, no traceback
        release_frames(exc)
        raise interrupted_early(exc) from None
    except BaseException as exc:
        release_frames(exc)  # the job's futures, held by the frames below (see Trainer.fit)
        raise


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


@dataclass(frozen=True)
class RunJob:
    """``dt.run``'s arguments by concern: the function and its config, the named data sets,
    and the same data, cluster and recovery records a Trainer's fit builds
    (:mod:`dask_train.policy._settings`, :mod:`dask_train.api._settings`), so each value is
    checked once, with one wording, whichever door it came through."""

    fn: Any
    config: Any
    sets: Any
    data: DataSettings
    cluster: ClusterSettings
    recovery: RecoverySettings
    stop: Any = ()
    callbacks: Any = ()
    resume: bool = False
    data_mode: Any = "auto"

    @classmethod
    def of(cls, s: Mapping[str, Any]) -> RunJob:
        """The records of ``dt.run``'s keyword arguments ``s`` (by name, as given; the named
        data sets as every later step reads them, see :func:`_data_sets`)."""
        return cls(
            fn=s["fn"], config=s["config"], sets=_data_sets(s["data"]),
            data=DataSettings(batch_size=s["batch_size"], epochs=s["epochs"],
                              shuffle=s["shuffle"], seed=s["seed"],
                              blocks_ahead=s["blocks_ahead"]),
            cluster=ClusterSettings(workers=s["workers"], device=s["device"],
                                    timeout=s["timeout"], resources=s.get("resources")),
            # A rank's non-finite metric is reported, never a reason to stop: the function
            # decides what to do about its own loss.
            recovery=RecoverySettings(checkpoint=s["checkpoint"], failure=s["failure"],
                                      on_nan="skip"),
            stop=s["stop"] or (), callbacks=s["callbacks"] or (), resume=bool(s["resume"]),
            data_mode=s.get("data_mode", "auto"))

    def problems(self) -> list[str]:
        """Every problem with the arguments (nothing is sent anywhere)."""
        from dask_train.policy._data_mode import check_data_mode

        problems = _check_fn(self.fn, self.config)
        problems += _check_data(self.sets)
        sets = self.sets if isinstance(self.sets, Mapping) else {}
        first = next(iter(sets.values()), None)
        x = first[0] if isinstance(first, tuple) and len(first) == 2 else first
        problems += check_data_mode(self.data_mode, full_batch=False, name="data_mode",
                                    in_memory=x is not None and not is_lazy(x))
        problems += self.cluster.problems(ranges=True)
        problems += self.data.problems()
        problems += stop_problems(self.stop)
        problems += callback_problems(self.callbacks)
        problems += self.recovery.problems()
        if self.resume and self.recovery.checkpoint is None:
            problems.append("resume=True needs checkpoint=dt.CheckpointConfig(path) (or a "
                            "directory): it continues from the newest checkpoint under that path.")
        return problems


def check_run(s: Mapping[str, Any]) -> list[str]:
    """Every problem with ``dt.run``'s keyword arguments ``s`` (nothing is sent anywhere)."""
    return RunJob.of(s).problems()


def _check_fn(fn: Any, config: Any) -> list[str]:
    if not callable(fn):
        return [f"fn={fn!r} is not callable: pass the training function, def train(ctx, ...)."]
    if config is not None and not (isinstance(config, Mapping) and
                                   all(isinstance(k, str) for k in config)):
        return [f"config={config!r} is invalid: pass a dict of the function's keyword arguments."]
    try:
        inspect.signature(fn).bind(None, **dict(config or {}))
    except TypeError as exc:
        name = getattr(fn, "__name__", repr(fn))
        return [f"{name}(ctx, **config) cannot be called with config={dict(config or {})!r} "
                f"({exc}): the function takes ctx first, then the config's keys as arguments."]
    except ValueError:  # a builtin without a signature: it is called as it is
        pass
    return []


def _data_sets(data: Any) -> Any:
    """``data=`` with each Hugging Face ``datasets.Dataset`` as its columns, one dask array of
    records read in blocks on the workers (:func:`~dask_train.data._hf_datasets.as_arrays`):
    from here on it is several inputs like any other, for the checks, the small sets and the
    streamed set alike. A value that cannot be read so is kept as given, for
    :func:`_check_data` to name its problems."""
    if not isinstance(data, Mapping) or kind_of(data) is not None:
        return data
    sets = {}
    for name, value in data.items():
        try:
            sets[name] = as_arrays(value, name=f"data[{name!r}]")
        except InvalidInput:
            sets[name] = value
    return sets


def _check_data(data: Any) -> list[str]:
    if data is None:
        return []
    kind = kind_of(data)
    if kind is not None:
        return [f"data is a datasets.{kind}: pass its splits by name, data={{'train': "
                "dd['train'], 'val': dd['test']} (the first is streamed to the ranks, the others "
                "go whole to every rank)."]
    if not isinstance(data, Mapping) or not data or not all(isinstance(k, str) for k in data):
        return [f"data={type(data).__name__} is invalid: pass a dict of named data sets, "
                "{'train': (X, y)} (the first is streamed to the ranks)."]
    from dask_train.api._check_data import check_data
    from dask_train.data._blocks import as_dask_array

    problems = []
    for name, value in data.items():
        try:  # a datasets object _data_sets could not read: its problems
            value = as_arrays(value, name=f"data[{name!r}]")
        except InvalidInput as exc:
            problems += exc.problems
            continue
        x, y = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
        if isinstance(value, (tuple, list)) and not (isinstance(value, tuple) and len(value) == 2):
            problems.append(f"data[{name!r}] is a {type(value).__name__} of {len(value)}: pass "
                            "(X, y), or X alone.")
            continue
        try:
            X = as_dask_array(x, name=f"data[{name!r}] X")
            Y = as_dask_array(y if y is not None else np.zeros(X.shape[0], dtype=np.int8))
        except InvalidInput as exc:
            problems += exc.problems
            continue
        problems += [f"data[{name!r}]: {p}" for p in check_data(X, Y)]
    return problems


def _pickled(fn: Any) -> bytes:
    from dask_train.models._transport import dumps_by_value

    try:
        return dumps_by_value(fn)
    except Exception as exc:
        raise InvalidInput([f"the function {getattr(fn, '__name__', fn)!r} cannot be pickled "
                            f"({type(exc).__name__}: {exc}): it travels to the workers; create "
                            "what it closes over (a model, a lock, a file) inside it."]) from None


def _small_sets(data: Mapping[str, Any] | None) -> dict[str, Any]:
    """The named sets after the first, in memory (every rank gets them whole)."""
    if not data:
        return {}
    from dask_train.data._inputs import as_records

    out: dict[str, Any] = {}
    problems = []
    for name, value in list(data.items())[1:]:
        x, y = value if isinstance(value, tuple) else (value, None)
        parts: list[Any] = []
        for part in (x, y):
            if part is None:
                parts.append(None)
                continue
            part = as_records(part) if isinstance(part, Mapping) else part
            compute = getattr(part, "compute", None)
            nbytes = getattr(part, "nbytes", 0)
            if nbytes and nbytes > SMALL_BYTES:
                problems.append(f"data[{name!r}] is {nbytes / 2**20:.0f} MiB: the sets after the "
                                f"first travel whole to every rank (at most {SMALL_BYTES >> 20} "
                                "MiB); stream it as the first, or evaluate on a sample.")
                break
            parts.append(writable(compute() if callable(compute) else part))
        else:
            out[name] = tuple(parts)
    if problems:
        raise InvalidInput(problems)
    return out


#: The ledger's epoch bound when the function alone says how many epochs it trains.
_UNBOUNDED_EPOCHS = 1_000_000_000


def run_job(client: Client, job: RunJob, *, fn_blob: bytes, small: dict[str, Any],
            clock: dict[str, float]) -> RunResult:
    """Run the checked ``dt.run`` job on ``client``'s cluster."""
    ensure_plugin(client)
    timeout = float(job.cluster.timeout)
    placement = job.cluster.placement
    least, most = job.cluster.bounds(len(trainer_workers(client, placement)))
    alive, asked = _wait_for_workers(client, least, timeout=timeout, placement=placement)
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
    blocks, labels, train = _stream(client, job.sets, ranks=min(most, len(alive)),
                                    mode=str(job.data_mode), timeout=timeout,
                                    written=_written_rows(checkpoint) if job.resume else None)
    clock["persist"] = time.time() - t
    devices = probe_devices(client, job.cluster.device,
                            workers=trainer_workers(client, placement) if placement else None)
    ahead, most_ahead = job.data.read_ahead()
    spec = JobSpec(
        strategy="run", workers=most, batch_size=int(job.data.batch_size),
        epochs=int(job.data.epochs or _UNBOUNDED_EPOCHS), shuffle=bool(job.data.shuffle),
        seed=int(job.data.seed), blocks_ahead=ahead, blocks_ahead_max=most_ahead,
        timeout=timeout, stop=list(job.stop), callbacks=list(job.callbacks),
        checkpoint=checkpoint, failure=job.recovery.failure_config(),
        on_nan=str(job.recovery.on_nan), device_kind=devices.kind,
        devices=dict(devices.by_worker), placement=placement)
    # The engine's own settings: what the user's function gets besides ctx's data.
    run = RunSettings(train=train, labels=labels, small=small,
                      checkpointing=checkpoint is not None, epochs=job.data.epochs,
                      batch_size=int(job.data.batch_size), sharded_root=_staging(checkpoint))
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

    roles = plan(alive)
    settings = {"workers": job.cluster.workers, "epochs": job.data.epochs,
                "batch_size": job.data.batch_size, "seed": job.data.seed,
                "stop": list(job.stop), "resume": job.resume}
    run_callbacks(spec.callbacks, "on_fit_start", {
        "roles": roles, "rows": blocks.n_rows, "params": {**user_config, "run": settings}})
    started = time.time()
    controller = Controller(client, spec, make_engine=make_engine, plan_roles=plan, roles=roles,
                            rows=blocks.n_rows)
    controller.wanted.adopt(asked)
    asked.clear()
    try:
        outcome = controller.run_sync(resume=job.resume)
    finally:
        blocks.release()
    result = _result(outcome, wall_s=time.time() - started, clock=clock)
    run_callbacks(spec.callbacks, "on_fit_end", result)
    return result


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


def _wait_for_workers(client: Client, least: int, *, timeout: float,
                      placement: Placement) -> tuple[dict[str, int], list[Any]]:
    """The live workers, once there are at least ``least`` of them (up to ``timeout``), and the
    placeholder tasks that asked for them, for the job's controller to hold until its ranks run.

    While it waits, the scheduler holds ``least`` placeholder tasks, so that an adaptive cluster
    grows to them (see :mod:`dask_train.controller._wanted`): not one per worker lacking, as a
    running job holds, since the workers there are have no task yet and the scheduler's target
    counts the tasks only. With resources, the workers counted are those that declare them."""
    deadline = time.monotonic() + timeout
    alive = trainer_workers(client, placement)
    asked: list[Any] = []
    if len(alive) < least and current_scope() is None:
        token = uuid.uuid4().hex[:12]
        client.run_on_scheduler(weigh_placeholders)
        asked = [placeholder(client, token, n) for n in range(least)]
    try:
        while len(alive) < least:
            if time.monotonic() > deadline:
                if placement:
                    raise InvalidInput([placement.too_few(
                        need=least, what=f"workers={least} (after {timeout:g} s)",
                        declared=declared_resources(client))])
                raise InvalidInput([f"workers={least} or more are needed but the cluster has "
                                    f"{len(alive)} Dask workers after {timeout:g} s: add "
                                    "workers, or ask for fewer ranks."])
            time.sleep(0.2)
            alive = trainer_workers(client, placement)
    except BaseException:
        if asked:
            client.cancel(asked)
        raise
    return alive, asked


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


def _stream(client: Client, data: Mapping[str, Any] | None, *, ranks: int, mode: str = "auto",
            timeout: float = 120.0, written: list[int] | None = None,
            ) -> tuple[BlockSet, bool, str | None]:
    """The streamed data set's blocks, whether it has targets, and its name: sent in blocks
    when in memory, persisted on the workers, or read from storage each epoch (``mode``, as
    ``Trainer.fit(data=...)``). A dask collection is cut into the blocks ``written`` (the rows
    of each block a resumed checkpoint's ledger was written for) when it has as many rows,
    whatever cut its job chose for its ranks; else into at least two blocks a rank."""
    if not data:
        return BlockSet([], []), False, None
    name, value = next(iter(data.items()))
    x, y = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
    train = TrainingData.of(x, y, name=f"data[{name!r}] X")
    labels = train.y is not None
    train = train.with_targets()
    if not train.in_memory:
        as_written = None if written is None else train.with_row_blocks(written)
        train = as_written if as_written is not None else train.with_blocks_for(ranks)
    blocks = train.blocks(client, mode=mode, labels=False, timeout=timeout)
    return blocks, labels, name


def _result(outcome: Outcome, *, wall_s: float, clock: Mapping[str, float]) -> RunResult:
    ranks = sorted(outcome.ending.trainers, key=lambda r: r["trainer"])
    return RunResult(returns=[r.pop("returned", None) for r in ranks], ranks=ranks,
                     **job_fields(outcome, wall_s=wall_s, clock=clock))
