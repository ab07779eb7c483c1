"""``dask-train run module:function [CONFIG.yaml]``: the user's own training function (``dt.run``)
from the command line, its settings in a YAML file checked in full before any work."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dask_train.errors import InvalidInput

EXAMPLE = """\
# dask-train run mytrain:train CONFIG.yaml
config: {lr: 0.001, epochs: 5}      # the function's keyword arguments: train(ctx, lr=..., epochs=...)
data:
  train: {X: data/X.npy, y: data/y.npy}       # streamed: ctx.batches()
  val: {X: data/Xv.npy, y: data/yv.npy}        # whole on every rank: ctx.dataset("val")
  chunk_rows: 100000
run:                                # dt.run's arguments
  workers: 2                        # or [least, most]
  batch_size: 64
  checkpoint: runs/ckpt             # a directory or fsspec URL; keep: 3
  max_failures: 3
  resume: false
  # resources: {GPU: 1}             # ranks only on workers started with --resources GPU=1
stop: {accuracy: 0.97, minutes: 30}
cluster: {scheduler: null, n_workers: 2}
out: runs/mine                      # the run writes into runs/mine/run
"""

_SECTIONS = ("config", "data", "run", "stop", "cluster", "out")
_RUN_KEYS = ("workers", "epochs", "batch_size", "seed", "shuffle", "blocks_ahead", "timeout",
             "device", "checkpoint", "keep", "max_failures", "resume", "resources")


def add_run_command(commands: Any) -> None:
    """The ``run`` sub-command."""
    command = commands.add_parser(
        "run", help="run your own training function on every rank (dt.run)",
        description="Run FUNCTION(ctx, **config) on one rank per Dask worker (dt.run), with the "
        "config's data, stop conditions and checkpoints; the config is checked in full first.",
        epilog=f"example config:\n\n{EXAMPLE}", formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_argument("target", help="module:function, the module importable from the "
                         "config's directory or the current one")
    command.add_argument("config", type=Path, nargs="?", default=None, help="the YAML config")
    command.add_argument("--scheduler", default=None, help="Dask scheduler address")
    command.add_argument("--out", type=Path, default=None,
                         help="the runs' directory: the run writes into OUT/run (default: the "
                         "config's out, else runs/run-TIME)")
    command.add_argument("--check", action="store_true", help="check and exit")


def run_command(args: argparse.Namespace) -> int:
    """``dask-train run``: check everything, run, write the run directory."""
    from dask_train.cli._commands import _connect, run_dir

    config, fn, sections = _load(args)
    kwargs = _run_kwargs(config, fn, sections)
    if args.check:
        print(f"{args.target}: ok for dask-train run")
        return 0
    import dask_train as dt

    with _connect(config, args.scheduler) as client:
        result = dt.run(fn, client=client, **kwargs)
    out = run_dir(config, "run", args.out)
    summary = {"stopped_by": result.stopped_by, "steps": result.steps, "samples": result.samples,
               "epochs_completed": result.epochs_completed, "wall_s": result.wall_s,
               "generations": result.generations, "checkpoint": result.checkpoint,
               "returns": [repr(r) for r in result.returns]}
    result.history.to_csv(out / "history.csv", index=False)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary, indent=2, default=str))
    print(f"run      {out}")
    return 0


def _load(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """The checked config and the function; every problem at once."""
    from dask_train.cli._config import Config, read_sections

    path = args.config
    sections, out = read_sections(path, _SECTIONS, command="run")
    problems: list[str] = []
    base = (path or Path("x")).resolve()
    config = Config(path=base, model={}, data=sections["data"], trainer={},
                    stop=sections["stop"], cluster=sections["cluster"], out=out)
    problems += [f"run.{k}: unknown setting; use {', '.join(_RUN_KEYS)}."
                 for k in sections["run"] if k not in _RUN_KEYS]
    problems += [f"data.{k}: unknown data set; use train, validation (or any name), chunk_rows."
                 for k, v in sections["data"].items() if k != "chunk_rows" and
                 not (isinstance(v, Mapping) and "X" in v)]
    fn = None
    try:
        fn = _function(args.target, base.parent)
    except InvalidInput as exc:
        problems += exc.problems
    if fn is not None:
        problems += _set_problems(args.target, fn, sections["data"])
    if problems:
        raise InvalidInput(problems)
    return config, fn, sections


def _function(target: str, directory: Path) -> Any:
    """``module:function``, importable from ``directory`` or the current one, sent by value."""
    import cloudpickle

    module_name, _, name = target.partition(":")
    if not module_name or not name:
        raise InvalidInput([f"{target!r} is not module:function, e.g. mytrain:train."])
    for where in (str(directory), str(Path.cwd())):
        if where not in sys.path:
            sys.path.insert(0, where)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInput([f"{target!r}: module {module_name!r} does not import ({exc}); run "
                            "from its directory, or put it beside the config."]) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise InvalidInput([f"{target!r}: {module_name} has no function {name!r}."])
    if not getattr(module, "__file__", "").startswith(sys.prefix):
        cloudpickle.register_pickle_by_value(module)  # the workers may not have the file
    return fn


def asked_sets(fn: Any) -> dict[str, list[str]]:
    """The data set names ``fn`` asks its context for as string constants in its own code:
    ``{"batches": [...], "dataset": [...]}`` (``ctx.batches("train")``, ``ctx.dataset("val")``,
    ``ctx`` being its first parameter, whatever its name). Names it computes, and calls in
    other functions it calls, are not seen; nothing when its source cannot be read.

    Examples
    --------
    >>> def train(ctx):
    ...     xv, yv = ctx.dataset("val")
    ...     for xb, yb in ctx.batches("train", batch_size=64): ...
    >>> asked_sets(train)
    {'batches': ['train'], 'dataset': ['val']}
    """
    asked: dict[str, list[str]] = {"batches": [], "dataset": []}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        first = next(iter(inspect.signature(fn).parameters))
    except (OSError, TypeError, SyntaxError, StopIteration, ValueError):
        return asked
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in asked and isinstance(node.func.value, ast.Name) \
                and node.func.value.id == first:
            name = node.args[0] if node.args else next(
                (k.value for k in node.keywords if k.arg == "name"), None)
            if isinstance(name, ast.Constant) and isinstance(name.value, str) \
                    and name.value not in asked[node.func.attr]:
                asked[node.func.attr].append(name.value)
    return asked


def _set_problems(target: str, fn: Any, data: Mapping[str, Any]) -> list[str]:
    """The data sets ``fn``'s code asks for (:func:`asked_sets`) that the config does not give:
    found here, before any work, not as every rank's failure. The first set of ``data:`` is
    the streamed one (``ctx.batches``), the others the small ones (``ctx.dataset``)."""
    names = [k for k in data if k != "chunk_rows"]
    streamed, small = names[:1], names[1:]
    asked = asked_sets(fn)
    problems = [f"{target} reads ctx.batches({n!r}), but the config streams "
                f"{streamed[0] if streamed else 'no data'!r}: name the first set of data: {n!r}."
                for n in asked["batches"] if n not in streamed]
    problems += [f"{target} reads ctx.dataset({n!r}), but the config's data has no set {n!r} "
                 f"(its small sets: {small}; {streamed[0] if streamed else 'none'!r} is streamed): "
                 f"name one of data's sets after the first {n!r}, e.g. {n}: {{X: Xv.npy, y: "
                 "yv.npy}."
                 for n in asked["dataset"] if n not in small]
    return problems


def _run_kwargs(config: Any, fn: Any, sections: Mapping[str, Any]) -> dict[str, Any]:
    """``dt.run``'s keyword arguments from the config (its data loaded lazily, as dask arrays)."""
    import dask_train as dt
    from dask_train.cli._commands import load_data

    settings = dict(sections["run"])
    chunk_rows = int(config.data.get("chunk_rows", 100_000))
    data = {}
    for name in [k for k in config.data if k != "chunk_rows"]:
        spec = config.dataset(name)
        X, y = load_data(spec, chunk_rows=chunk_rows)
        data[name] = X if y is None else (X, y)
    path, keep = settings.pop("checkpoint", None), settings.pop("keep", 3)
    failures = settings.pop("max_failures", None)
    if isinstance(settings.get("workers"), list):
        settings["workers"] = tuple(settings["workers"])
    kwargs: dict[str, Any] = dict(
        settings, data=data or None, config=dict(sections["config"]),
        stop=config.stop_conditions(),
        checkpoint=None if path is None else dt.CheckpointConfig(config.resolve(str(path)),
                                                                 keep=keep),
        failure=None if failures is None else dt.FailureConfig(max_failures=failures))
    from dask_train.api._run import check_run

    problems = check_run({**_defaults(), **kwargs, "fn": fn})
    if problems:
        raise InvalidInput(problems)
    return kwargs


def _defaults() -> dict[str, Any]:
    from dask_train.api._run import run

    return {k: p.default for k, p in inspect.signature(run).parameters.items()
            if p.default is not inspect.Parameter.empty}
