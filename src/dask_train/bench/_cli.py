"""``dask-train bench``: the throughput grid on a cluster, as a table, a CSV and a plot.

Light at import (argparse only): the ``dask-train`` parser is built on every call of the command.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Measure async-ps training throughput over a grid of trainers x parameter servers x model sizes
(x link rates) on a Dask cluster: --scheduler ADDR, an embedded LocalCluster (the default), or,
with --link-rate, a cluster of network-namespace hosts on this machine whose links are shaped
with tc (needs root). Prints a table, writes bench.csv, bench.md, bench.json and bench.png
(throughput against workers, one line per ps count) to --out, and the cost model's ps recommendation for
1 to 1,000 workers, calibrated on the measured points."""


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") \
            from None


def _rates(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of Mbit/s") \
            from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    parser.add_argument("--scheduler", default=None, help="Dask scheduler address (default: embedded)")
    parser.add_argument("--workers", type=_ints, default=[1, 2, 4], help="trainer counts, e.g. 1,2,4")
    parser.add_argument("--ps", type=_ints, default=[1, 2, 4], help="parameter-server counts, e.g. 1,2,4")
    parser.add_argument("--model", action="append", default=None,
                        help="MLP layer widths, e.g. 64-1024-1024-10; repeat for several "
                        "(default: 64-256-10)")
    parser.add_argument("--link-rate", type=_rates, default=None,
                        help="Mbit/s of every host's link, e.g. 100,1000: runs on network-namespace "
                        "hosts on this machine (root)")
    parser.add_argument("--hosts", type=int, default=None,
                        help="with --link-rate: worker hosts (default: most workers + most ps)")
    parser.add_argument("--n-workers", type=int, default=None,
                        help="embedded cluster: Dask workers (default: the most trainers)")
    parser.add_argument("--seconds", type=float, default=8.0, help="training time per point")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--n-samples", type=int, default=200_000, help="rows of digits to train on")
    parser.add_argument("--out", type=Path, default=Path("bench-output"), help="output directory")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def check(args: argparse.Namespace) -> list[str]:
    """Problems with the options, each naming the option, the value and the fix."""
    problems = []
    if args.link_rate is not None and args.scheduler:
        problems.append(f"--link-rate={args.link_rate} with --scheduler={args.scheduler!r}: link "
                        "rates are set on hosts this command creates; drop one of them.")
    if args.hosts is not None and args.link_rate is None:
        problems.append(f"--hosts={args.hosts} needs --link-rate (it sizes the namespace cluster).")
    need = max(args.workers or [1]) + max(args.ps or [1])
    if args.hosts is not None and args.hosts < max(args.workers or [1]):
        problems.append(f"--hosts={args.hosts} is fewer than the most trainers "
                        f"({max(args.workers)}): use --hosts {need}.")
    for name in ("n_samples", "batch_size"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: use an "
                            "integer >= 1.")
    if args.n_workers is not None and args.n_workers < 1:
        problems.append(f"--n-workers={args.n_workers} is invalid: use an integer >= 1.")
    return problems


def run(args: argparse.Namespace) -> int:
    """Run the grid and write its outputs; return the exit status."""
    from dask_train.bench._grid import Grid, parse_widths
    from dask_train.errors import InvalidInput

    problems = check(args)
    models = []
    for text in args.model or ["64-256-10"]:
        try:
            models.append(parse_widths(text))
        except InvalidInput as exc:
            problems += exc.problems
    grid = None
    try:
        grid = Grid(workers=tuple(args.workers), ps=tuple(args.ps),
                    models=tuple(models) or ((64, 256, 10),),
                    link_rates=tuple(args.link_rate or [None]), seconds=args.seconds,
                    batch_size=args.batch_size, n_samples=args.n_samples)
    except InvalidInput as exc:
        problems += exc.problems
    if problems:
        raise InvalidInput(problems)
    assert grid is not None
    started = time.time()
    if args.link_rate is not None:
        groups, where = _on_namespaces(args, grid)
    else:
        groups, where = _on_cluster(args, grid)
    _report(groups, args.out, where=where, seconds=time.time() - started)
    return 0


def _on_cluster(args: argparse.Namespace, grid: Any) -> tuple[list[Any], str]:
    from dask_train.bench._grid import run_grid
    from dask_train.runtime import connect

    n_workers = args.n_workers or max(grid.workers)
    client = connect(args.scheduler, n_workers=None if args.scheduler else n_workers,
                        quiet=True)
    try:
        where = args.scheduler or f"embedded LocalCluster, {n_workers} workers"
        return run_grid(client, grid, progress=not args.no_progress), where
    finally:
        client.close()


def _on_namespaces(args: argparse.Namespace, grid: Any) -> tuple[list[Any], str]:
    from dask_train.bench._grid import run_grid
    from dask_train.bench._netns import Link, NetnsCluster
    from dask_train.runtime import connect

    hosts = args.hosts or max(grid.workers) + max(grid.ps)
    with NetnsCluster(n_workers=hosts, link=Link(rate_mbit=grid.link_rates[0]),
                      memory_limit="2GiB") as cluster:
        client = connect(cluster.scheduler_address, quiet=True)

        def set_link(mbit: float | None) -> None:
            for host in [cluster.scheduler, *cluster.hosts]:
                assert host is not None
                cluster.set_link(host, Link(rate_mbit=mbit))

        try:
            groups = run_grid(client, grid, set_link=set_link, progress=not args.no_progress)
        finally:
            client.close()
    return groups, f"{hosts} network-namespace hosts on this machine"


def _report(groups: list[Any], out: Path, *, where: str, seconds: float) -> None:
    from dask_train.bench._output import (
        plot,
        recommendation_table,
        recommendations,
        rows_of,
        table,
        write_csv,
        write_json,
    )

    rows = rows_of(groups)
    measured = table(rows)
    recs = recommendation_table(recommendations(groups))
    out.mkdir(parents=True, exist_ok=True)
    text = (f"# dask-train bench\n\nCluster: {where}; {seconds:.0f} s in all.\n\n{measured}\n\n"
            "Recommended parameter servers (the cost model calibrated on the points marked "
            f"'yes', extrapolated to hosts like these):\n\n{recs}\n")
    (out / "bench.md").write_text(text)
    paths = [write_csv(rows, out / "bench.csv"), out / "bench.md",
             write_json(groups, out / "bench.json", cluster=where, seconds=seconds),
             plot(groups, out / "bench.png", title=f"dask-train bench: {where}")]
    print()
    print(measured)
    print()
    print(recs)
    print()
    for path in paths:
        print(f"wrote {path}")
