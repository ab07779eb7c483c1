"""``dask-train``: the command line.

``dask-train demo`` trains the digits MLP on the embedded cluster (or on ``--scheduler ADDR``),
by default with ``strategy="auto"`` (async-ps, sync or one process, whichever the costs measured
on the cluster predict fastest), and writes what it measured to ``--out``.
``dask-train train|search|predict CONFIG.yaml`` run a job described by a YAML config (``--help``
of each shows an example) and write a run directory, each command its own (``out/train``,
``out/search``, ``out/predict``); ``dask-train run module:function
CONFIG.yaml`` runs your own training function on every rank (``dt.run``); ``dask-train launch
script.py`` runs a torchrun script, unchanged, on one rank per worker (``dt.launch``). ``dask-train bench``
measures throughput over a grid of trainers x parameter servers x model sizes (x link rates).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dask-train", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="train an MLP on 1.1M augmented digits (strategy auto: async-ps, sync or one process)",
        description="Train MLP 64-100-10 on augmented digits (2 trainers, 1 scorer; async-ps with "
        "1 server, sync, or one process, as --strategy says) until held-out accuracy reaches "
        "--target or --seconds pass.",
    )
    demo.add_argument("--out", type=Path, default=Path("demo-output"), help="output directory")
    demo.add_argument("--n-samples", type=int, default=1_100_000, help="training rows to generate")
    demo.add_argument("--scheduler", default=None, help="Dask scheduler address (default: embedded)")
    demo.add_argument("--target", type=float, default=0.95, help="held-out accuracy to stop at")
    demo.add_argument("--seconds", type=float, default=120.0, help="time limit")
    demo.add_argument("--workers", type=int, default=2, help="trainers")
    demo.add_argument("--ps", type=int, default=1, help="parameter servers")
    demo.add_argument("--strategy", choices=("auto", "async-ps", "sync"), default="auto",
                      help="auto (default): the fastest, measured on the cluster")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.add_argument("--checkpoint", default=None,
                      help="checkpoint directory or fsspec URL (every 10 s, newest 3 kept)")
    demo.add_argument("--resume", action="store_true",
                      help="continue from the newest checkpoint under --checkpoint")
    _add_config_commands(commands)
    from dask_train.cli._run import add_run_command

    add_run_command(commands)
    from dask_train.cli._launch import add_launch_command

    add_launch_command(commands)
    from dask_train.bench._cli import DESCRIPTION, add_arguments

    add_arguments(commands.add_parser(
        "bench", help="measure throughput: trainers x parameter servers x model size x link rate",
        description=DESCRIPTION))
    return parser


_CONFIG_COMMANDS = {
    "train": "fit a dt.Trainer on the config's data and write the run (history, plot, model)",
    "search": "search hyper-parameters (dt.search): trials, search plot, the best model",
    "predict": "predict with a trained model over a data set (dt.predict)",
}


def _add_config_commands(commands: Any) -> None:
    from dask_train.cli._config import EXAMPLE

    for name, text in _CONFIG_COMMANDS.items():
        command = commands.add_parser(
            name, help=text, description=f"{text[0].upper()}{text[1:]}. The config is checked in "
            "full before any work; every problem is reported at once.",
            epilog=f"example config:\n\n{EXAMPLE}", formatter_class=argparse.RawDescriptionHelpFormatter)
        command.add_argument("config", type=Path, help="the YAML config file")
        command.add_argument("--scheduler", default=None,
                             help="Dask scheduler address (default: the config's, else embedded)")
        command.add_argument("--out", type=Path, default=None,
                             help=f"the runs' directory: this command writes into OUT/{name} "
                             f"(default: the config's out, else runs/{name}-TIME)")
        command.add_argument("--no-progress", action="store_true", help="hide the progress bar")
        command.add_argument("--check", action="store_true",
                             help="check the config and exit without running anything")


def run_config(args: argparse.Namespace) -> int:
    """``dask-train train|search|predict CONFIG.yaml``."""
    from dask_train.cli import _commands
    from dask_train.cli._config import load_config

    config = load_config(args.config, command=args.command)
    if args.check:
        print(f"{args.config}: ok for dask-train {args.command}")
        return 0
    run = getattr(_commands, args.command)
    outcome = run(config, scheduler=args.scheduler, out=args.out, progress=not args.no_progress)
    print(json.dumps(outcome["summary"], indent=2, default=str))
    for name, path in outcome["paths"].items():
        print(f"{name:<8} {path}")
    return 0


def demo(args: argparse.Namespace) -> int:
    """Run the digits job and write summary.json, history.csv, scores.png, model.safetensors."""
    import torch

    import dask_train as dt
    from dask_train.report import summary_table, write_run

    problems = []
    if args.n_samples < 1:
        problems.append(f"--n-samples={args.n_samples} is invalid: use an integer >= 1.")
    if not 0 < args.target <= 1:
        problems.append(f"--target={args.target} is invalid: use an accuracy in (0, 1].")
    if not args.seconds > 0:
        problems.append(f"--seconds={args.seconds} is invalid: use a number of seconds > 0.")
    if args.resume and not args.checkpoint:
        problems.append("--resume needs --checkpoint DIR: the directory to resume from.")
    if problems:
        raise dt.InvalidInput(problems)
    started = time.time()
    client = dt.connect(args.scheduler)
    try:
        X, y = dt.datasets.digits(n_samples=args.n_samples, seed=0)
        Xv, yv = dt.datasets.digits_test()
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(64, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10)
        )
        trainer = dt.Trainer(
            net, loss="cross_entropy", optimizer="adam", lr=1e-3, strategy=args.strategy,
            ps=args.ps, workers=args.workers, scorer=1, batch_size=128, epochs=5,
            # The job can reach its target within 0.6 s of training (2 cores here): a score
            # each 0.05 s (360 held-out images, a millisecond) draws the curve in scores.png
            # with 8-12 points; at 0.2 s it had 2-4, from 0.92 on.
            score_every=0.05,
            stop=[dt.StopAtScore("accuracy", args.target), dt.StopAfter(seconds=args.seconds)],
            progress=not args.no_progress, client=client,
            checkpoint=dt.CheckpointConfig(args.checkpoint, every_seconds=10.0, keep=3)
            if args.checkpoint else None,
        )
        result = trainer.fit(X, y, validation=(Xv, yv), resume=args.resume)
    finally:
        client.close()
    summary = result.summary()
    summary["total_s"] = time.time() - started
    assert isinstance(result.model, torch.nn.Module)  # the demo trains a torch MLP
    paths = write_run(args.out, history=result.history, summary=summary, module=result.model)
    print()
    print(summary_table(summary))
    print()
    for name, path in paths.items():
        print(f"{name:<8} {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dask-train`` console script."""
    from dask_train.errors import DaskTrainError

    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            return demo(args)
        if args.command in _CONFIG_COMMANDS:
            return run_config(args)
        if args.command == "run":
            from dask_train.cli._run import run_command

            return run_command(args)
        if args.command == "launch":
            from dask_train.cli._launch import launch_command

            return launch_command(args)
        if args.command == "bench":
            from dask_train.bench._cli import run

            return run(args)
    except DaskTrainError as exc:
        print(f"dask-train: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())

