"""``dt.run``: the user's own training function on every rank, with the data, scores, stop
conditions, checkpoints and recovery a ``Trainer`` job has (one controller for both)."""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dask_train.api._run_result import RunResult
from dask_train.errors import InvalidInput

if TYPE_CHECKING:
    from distributed import Client

    from dask_train.checkpoint import CheckpointConfig
    from dask_train.policy import Callback, FailureConfig, StopCondition

logger = logging.getLogger(__name__)

#: Named data sets besides the streamed one go to every rank whole, inside its task, up to this.
SMALL_BYTES = 64 << 20
_DEVICES = ("auto", "cpu", "cuda")


def run(fn: Callable[..., Any], *, data: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None, workers: int | tuple[int, int] | None = None,
        epochs: int | None = None, batch_size: int = 64, client: Client | None = None,
        stop: Sequence[StopCondition] = (), callbacks: Sequence[Callback] = (),
        checkpoint: CheckpointConfig | None = None, failure: FailureConfig | None = None,
        resume: bool = False, seed: int = 0, shuffle: bool = True, blocks_ahead: int | str = "auto",
        timeout: float = 120.0, device: str = "auto", data_mode: str = "auto") -> RunResult:
    """Run ``fn(ctx, **config)`` on one rank per Dask worker, as one job.

    Parameters
    ----------
    fn : callable
        ``fn(ctx, **config)``: ``ctx`` is the rank's :class:`~dask_train.engines.run.context.
        RunContext`. Defined anywhere (a script, a notebook): it travels by value.
    data : dict, optional
        Named data sets: the first (``{"train": (X, y)}`` or ``X`` alone; dask or numpy arrays,
        DataFrames, dicts of them) is read with ``ctx.batches()``, each row once per epoch over
        the ranks; the others go whole to every rank (``ctx.dataset(name)``, 64 MiB at most).
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
    problems = check_run(settings)
    if problems:
        raise InvalidInput(problems)
    fn_blob, small = _pickled(fn), _small_sets(data)
    from dask_train.runtime import default_client

    t = time.time()
    client = client if client is not None else default_client()
    clock["connect"] = time.time() - t
    from dask_train.api._run_job import run_job

    return run_job(client, settings, fn_blob=fn_blob, small=small, clock=clock)


def check_run(s: Mapping[str, Any]) -> list[str]:
    """Every problem with ``dt.run``'s arguments (nothing is sent anywhere)."""
    from dask_train.checkpoint import CheckpointConfig
    from dask_train.policy import Callback, FailureConfig, StopCondition

    problems = _check_fn(s["fn"], s["config"])
    problems += _check_data(s["data"])
    from dask_train.policy._data_mode import check_data_mode

    data = s["data"] if isinstance(s["data"], Mapping) else {}
    first = next(iter(data.values()), None)
    x = first[0] if isinstance(first, tuple) and len(first) == 2 else first
    problems += check_data_mode(
        s.get("data_mode", "auto"), full_batch=False, name="data_mode",
        in_memory=x is not None and not hasattr(x, "dask") and not hasattr(x, "to_dask_array"))
    w = s["workers"]
    if not (w is None or _int(w, 1) or isinstance(w, tuple) and len(w) == 2 and
            all(_int(v, 1) for v in w) and w[0] <= w[1]):
        problems.append(f"workers={w!r} is invalid: pass a number of ranks >= 1, (least, most) "
                        "with 1 <= least <= most, or None for every worker.")
    for name, low in (("batch_size", 1), ("blocks_ahead", 1), ("seed", 0)):
        if not (_int(s[name], low) or name == "blocks_ahead" and s[name] == "auto"):
            problems.append(f"{name}={s[name]!r} is invalid: use an integer >= {low}"
                            f"{' or auto' if name == 'blocks_ahead' else ''}.")
    if s["epochs"] is not None and not _int(s["epochs"], 1):
        problems.append(f"epochs={s['epochs']!r} is invalid: use an integer >= 1, or None to let "
                        "the function say (ctx.epochs(n)).")
    timeout = s["timeout"]
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
            and math.isfinite(timeout) and timeout > 0):
        problems.append(f"timeout={timeout!r} is invalid: use a number of seconds > 0.")
    if s["device"] not in _DEVICES:
        problems.append(f"device={s['device']!r} is invalid: use one of {_DEVICES}.")
    problems += [f"stop[{i}]={c!r} is invalid: use dt.StopAtScore, dt.StopAfter, dt.StopAtStep "
                 "or dt.EarlyStopping." for i, c in enumerate(s["stop"] or ())
                 if not isinstance(c, StopCondition)]
    problems += [f"callbacks[{i}]={c!r} is invalid: subclass dt.Callback." for i, c in
                 enumerate(s["callbacks"] or ()) if not isinstance(c, Callback)]
    if s["checkpoint"] is not None and not isinstance(s["checkpoint"], CheckpointConfig):
        problems.append(f"checkpoint={s['checkpoint']!r} is invalid: pass "
                        "dt.CheckpointConfig(path, keep=3) or None.")
    if s["failure"] is not None and not isinstance(s["failure"], FailureConfig):
        problems.append(f"failure={s['failure']!r} is invalid: pass "
                        "dt.FailureConfig(max_failures=3) or None.")
    if s["resume"] and s["checkpoint"] is None:
        problems.append("resume=True needs checkpoint=dt.CheckpointConfig(path): it continues "
                        "from the newest checkpoint under that path.")
    return problems


def _int(value: Any, low: int) -> bool:
    return bool(isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                and value >= low)


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


def _check_data(data: Any) -> list[str]:
    if data is None:
        return []
    if not isinstance(data, Mapping) or not data or not all(isinstance(k, str) for k in data):
        return [f"data={type(data).__name__} is invalid: pass a dict of named data sets, "
                "{'train': (X, y)} (the first is streamed to the ranks)."]
    from dask_train.api._validate import check_data
    from dask_train.data._blocks import as_dask_array

    problems = []
    for name, value in data.items():
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
            parts.append(np.ascontiguousarray(compute() if callable(compute) else part))
        else:
            out[name] = tuple(parts)
    if problems:
        raise InvalidInput(problems)
    return out
