"""How many parameter servers per worker? Measured across hosts with slow links, and modelled.

Usage (as root: the hosts are Linux network namespaces)::

    python benchmarks/multihost.py [--rate 100] [--model 64-1024-1024-10] [--seconds 12] [--quick]

What runs: ``--hosts`` worker hosts (default 8) and a scheduler, each in its own network namespace
with its own address, joined by veth links through a bridge, running the real ``dask scheduler``
/ ``dask worker`` programs (``dask_train.bench.NetnsCluster``); every host's link is limited to
``--rate`` Mbit/s each way with ``tc``. On it, an MLP of 1.1 M parameters (4.5 MB of float32 per
message, so 0.36 s per message at 100 Mbit/s against ~10-20 ms of gradient) trains with
``strategy="async-ps"``, Adam, batch 128, ``prefetch=1``, no scorer, for trainers x servers =
{1, 2, 4} x {1, 2, 4}: with 8 hosts every role has a host of its own, as on a real cluster. The
network, not the 2 CPU cores the hosts share, is the bottleneck: the ``ps_wait`` column (the share
of the trainers' time spent waiting for the servers) and the CPU load say how far that held.

Each point's rate is the sum over trainers of samples over the time each trained (start-up left
out), over about ``--seconds`` of training. The cost model (``dask_train.policy.CostModel``) is
set up from a probe on the same cluster (a gradient, an Adam step, an echo between two hosts) and
calibrated on three points -- 1 trainer with 1 server, 4 with 1, 4 with 4 -- fitting the fixed
cost of an exchange, the share of the link rate a transfer gets and how much a trainer's replies
overlap its pushes; the six other points are predictions. Aim: within 25% of the measured rate.

Results: ``benchmarks/results/multihost.md`` / ``.json`` / ``.png`` (``multihost-quick.*`` with
``--quick``), with the ps the calibrated model recommends for 1 to 1,000 workers on hosts like
these.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

from _common import RESULTS_DIR, CpuLoad, cpu_load, environment, write_results

from dask_train.bench import Link, NetnsCluster, unavailable_reason
from dask_train.bench._grid import Grid, GroupResult, parse_widths, run_grid
from dask_train.bench._output import plot, recommendation_table, recommendations, table
from dask_train.runtime import connect

AIM = 0.25  # the largest |predicted / measured - 1| allowed on the points not calibrated on


@dataclass(frozen=True)
class Settings:
    hosts: int
    rate: float
    model: tuple[int, ...]
    workers: tuple[int, ...]
    ps: tuple[int, ...]
    seconds: float
    n_samples: int
    quick: bool

    @property
    def name(self) -> str:
        return "multihost-quick" if self.quick else "multihost"


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=8, help="worker hosts (namespaces)")
    parser.add_argument("--rate", type=float, default=None,
                        help="Mbit/s of every host's link (default 100, 200 with --quick)")
    parser.add_argument("--model", default=None,
                        help="MLP widths (default 64-1024-1024-10, 64-512-512-10 with --quick)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="training per point (default 12, 3 with --quick)")
    parser.add_argument("--n-samples", type=int, default=400_000, help="rows of digits")
    parser.add_argument("--quick", action="store_true", help="a 2 x 2 grid, to check it runs")
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    return Settings(
        hosts=args.hosts, rate=args.rate or (200.0 if quick else 100.0),
        model=parse_widths(args.model or ("64-512-512-10" if quick else "64-1024-1024-10")),
        workers=(1, 2) if quick else (1, 2, 4), ps=(1, 2) if quick else (1, 2, 4),
        seconds=args.seconds or (3.0 if quick else 12.0),
        n_samples=100_000 if quick else args.n_samples, quick=quick,
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    if reason := unavailable_reason():
        print(f"cannot run: {reason}")
        return 1
    grid = Grid(workers=settings.workers, ps=settings.ps, models=(settings.model,),
                link_rates=(settings.rate,), seconds=settings.seconds,
                n_samples=settings.n_samples)
    started = time.time()
    env = environment()
    with NetnsCluster(n_workers=settings.hosts, link=Link(rate_mbit=settings.rate),
                      memory_limit="2GiB") as cluster:
        client = connect(cluster.scheduler_address, quiet=True)
        try:
            # The hosts' processes are this process's children: "other load" is everyone else's.
            with cpu_load() as load:
                groups = run_grid(client, grid)
        finally:
            client.close()
    (group,) = groups
    unseen = [r for r in group.rows if not r["calibration_point"]]
    worst = max((abs(r["error"]) for r in unseen), default=float("nan"))
    recs = recommendations(groups)
    md = report(settings, group, worst=worst, load=load, recs=recommendation_table(recs),
                seconds=time.time() - started)
    png = plot(groups, RESULTS_DIR / f"{settings.name}.png",
               title=f"async-ps on {settings.hosts} hosts, {settings.rate:g} Mbit/s links")
    paths = write_results(settings.name, md, {
        "settings": settings.__dict__, "environment": env, "rows": group.rows,
        "probed": group.probed.__dict__,
        "calibrated": group.calibrated.__dict__ if group.calibrated else None,
        "worst_unseen_error": worst, "recommendations": recs,
        "cpu": {"machine": load.machine, "ours": load.ours, "other": load.foreign},
    })
    print(md)
    print(f"wrote {paths[0]}, {paths[1]}, {png}")
    return 0


def report(settings: Settings, group: GroupResult, *, worst: float, load: CpuLoad, recs: str,
           seconds: float) -> str:
    """The markdown page: what ran, the table, the model and whether the aim was met."""
    rows = group.rows
    probed, fitted = group.probed, group.calibrated
    lines = [
        f"# Parameter servers across hosts ({settings.hosts} namespace hosts, "
        f"{settings.rate:g} Mbit/s links)",
        "",
        f"MLP {'-'.join(map(str, settings.model))} ({rows[0]['params']:,} parameters), "
        f"async-ps, Adam, batch 128, prefetch=1, ~{settings.seconds:g} s of training per point; "
        f"{seconds:.0f} s in all. CPU: {load.machine:.2f} cores busy on the machine, "
        f"{load.foreign:.2f} of them other programs'.",
        "",
        table(rows),
        "",
    ]
    if load.foreign > 0.15:
        lines += [f"**Other programs used {load.foreign:.2f} cores during this run: the numbers "
                  "are those of a busy machine; run it again on a quiet one.**", ""]
    lines += [
        f"Probed: a step's gradient {probed.compute_s * 1e3:.1f} ms, Adam "
        f"{probed.update_s_per_param * probed.n_params * 1e3:.1f} ms per full update, link "
        f"{probed.link_bytes_per_s * 8 / 1e6:.0f} Mbit/s, an exchange's fixed cost "
        f"{probed.message_s * 1e3:.1f} ms.",
    ]
    if fitted is not None:
        lines.append(
            f"Calibrated: fixed cost {fitted.message_s * 1e3:.1f} ms, link efficiency "
            f"{fitted.link_efficiency:.2f}, overlap {fitted.overlap:.2f}.")
    verdict = "met" if worst <= AIM else "NOT met"
    lines += ["", f"Largest error on the points not calibrated on: {worst:.0%} "
              f"(aim <= {AIM:.0%}: {verdict}).", "",
              "Recommended servers, extrapolated to a cluster of hosts like these:", "", recs]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
