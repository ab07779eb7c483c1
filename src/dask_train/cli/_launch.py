"""``dask-train launch [options] script.py [args...]`` / ``-m module [args...]``: a torchrun
script, unchanged, on one rank per Dask worker (``dt.launch``), its options named as torchrun
names them."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

EPILOG = """\
examples:
  dask-train launch --workers 2 train.py --epochs 5          # the embedded cluster, 2 ranks
  dask-train launch --workers 2:4 --max-restarts 3 train.py  # 2 to 4 ranks, 3 restarts
  dask-train launch --scheduler tcp://10.0.0.5:8786 --include data/labels.json train.py
  dask-train launch -m mypkg.train --lr 0.1
  dask-train launch --resources GPU=1 train.py               # ranks on workers with a GPU

Each rank runs the program as `python script.py args` would, with torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...).
With --scheduler the script's directory (its .py files and --include) travels to the workers
and the program runs there: relative paths it writes are on the worker's disk.
"""


def parse_resources(text: str) -> dict[str, float]:
    """``GPU=1`` or ``GPU=1,MEM=2e9``, as ``dask worker --resources`` takes them."""
    resources: dict[str, float] = {}
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        name, sep, amount = part.partition("=")
        try:
            if not sep or not name:
                raise ValueError(part)
            resources[name] = float(amount)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not NAME=AMOUNT[,NAME=AMOUNT]: write it as to `dask worker "
                "--resources`, GPU=1") from None
    return resources


class _Interrupted(KeyboardInterrupt):
    """SIGTERM to the launcher: every rank is stopped as after Ctrl-C."""


def add_launch_command(commands: Any) -> None:
    """The ``launch`` sub-command."""
    from dask_train.launcher._job import parse_workers

    command = commands.add_parser(
        "launch", help="run a torchrun script on one rank per Dask worker (dt.launch)",
        description="Run SCRIPT (or -m MODULE) on one rank per Dask worker, as torchrun runs it "
        "on one process per GPU: torchrun's environment, every rank's output here, the whole "
        "gang restarted after a failure.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_argument("--workers", "--nnodes", type=parse_workers, default=None,
                         metavar="N|MIN:MAX",
                         help="ranks, one per Dask worker, or MIN:MAX (default: every worker; "
                         "the embedded cluster starts N, or MAX, workers)")
    command.add_argument("--max-restarts", "--max_restarts", type=int, default=0, metavar="K",
                         help="restarts of the whole gang after a failed rank or a lost worker "
                         "(a worker leaving with notice does not count; default 0)")
    command.add_argument("--scheduler", default=None, metavar="ADDR",
                         help="a Dask scheduler's address (default: the embedded cluster)")
    command.add_argument("--resources", type=parse_resources, default=None,
                         metavar="NAME=N[,NAME=N]",
                         help="Dask worker resources each rank holds (GPU=1): ranks only on "
                         "workers started with `dask worker --resources GPU=1`")
    command.add_argument("--timeout", type=float, default=120.0, metavar="S",
                         help="longest wait for the workers a gang needs (default 120 s)")
    command.add_argument("--grace", type=float, default=10.0, metavar="S",
                         help="seconds between a rank's SIGTERM and SIGKILL (default 10)")
    command.add_argument("--include", action="append", default=[], metavar="PATH",
                         help="a file or directory under the script's that travels with its "
                         ".py files (with --scheduler; repeatable)")
    command.add_argument("--in-place", action="store_true",
                         help="with --scheduler: the workers see this directory at the same "
                         "path (a shared file system); run there, ship nothing")
    command.add_argument("--log-dir", "--log_dir", type=Path, default=None, metavar="DIR",
                         help="the run's directory: every rank's output, summary.json "
                         "(default runs/launch-TIME-ID)")
    command.add_argument("--run-id", "--rdzv-id", default=None, metavar="ID",
                         help="TORCHELASTIC_RUN_ID (default: a new one)")
    command.add_argument("--quiet", action="store_true",
                         help="keep the ranks' output in --log-dir only")
    command.add_argument("-m", "--module", action="store_true",
                         help="run TARGET as a module, as python -m")
    command.add_argument("target", metavar="script.py|module", help="the program")
    command.add_argument("args", nargs=argparse.REMAINDER, help="the program's arguments")


def launch_command(args: argparse.Namespace) -> int:
    """``dask-train launch``: the run's exit status (the failing rank's, 130 after Ctrl-C)."""
    import dask_train as dt

    def on_sigterm(signum: int, frame: Any) -> None:
        raise _Interrupted()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = dt.launch(args.target, args.args, module=args.module, workers=args.workers,
                           max_restarts=args.max_restarts, scheduler=args.scheduler,
                           timeout=args.timeout, grace=args.grace, include=args.include,
                           ship=None if not args.in_place else False, log_dir=args.log_dir,
                           run_id=args.run_id, echo=not args.quiet,
                           resources=args.resources)
    except _Interrupted:
        print("dask-train launch: terminated (SIGTERM): every rank was stopped", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("dask-train launch: interrupted (Ctrl-C): every rank was stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return result.exit_code
