"""Each strategy on workers whose lifetime ends, and ends again, while the job trains, against the
same job on the same kind of cluster undisturbed.

Usage::

    python benchmarks/lifetime.py [--seconds 60] [--lifetime 20] [--stagger 5] [--workers 3]

A ``dask scheduler`` and ``--workers`` ``dask worker`` programs (one worker process of one
thread each), started as from a shell or as dask-jobqueue starts them in batch jobs: once with
``--lifetime 20s --lifetime-stagger 5s --lifetime-restart`` (each worker closes with notice
15-25 s after its start and its nanny starts a new one, over and over), once without. On each,
one job per strategy on the digits data (MLP 64-100-10, Adam), stopped after ``--seconds``:

* ``async-ps``: ``dt.Trainer``, one parameter server, ``workers=(1, N)`` trainers, a scorer;
* ``sync``: ``dt.Trainer``, ``workers=(1, N)`` ranks;
* ``dt.run``: a loop of the README's kind (DDP through ``ctx.prepare``, a report with a
  checkpoint each epoch of the rank's share), ``workers=(1, N)``.

Reported per strategy and cluster: held-out accuracy at the end, departures (hand-overs),
arrivals, roles on workers that left as a generation started or stopped (no hand-over then:
acted on as a loss, not counted), failures (the losses ``max_failures`` counts), samples
trained again (the departures' ``redone``), and the samples the job applied against those its
ledger counts (equal when each sample was applied once). No ``checkpoint=``: the hand-overs
keep the state in memory.

Nothing is asserted; tables go to ``benchmarks/results/lifetime.{md,json}``.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from _common import build_mlp, environment, markdown_table, write_results

import dask_train as dt


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _dask_cluster(workers: int, options: list[str], log_path: Path) -> Iterator[str]:
    """``dask scheduler`` and ``workers`` ``dask worker`` programs with ``options``, their
    output to ``log_path``; yields the scheduler's address (the job's ``dt.connect`` waits
    for its workers)."""
    dask = str(Path(sys.executable).parent / "dask")
    address = f"tcp://127.0.0.1:{_free_port()}"
    with log_path.open("w") as log:
        processes = [subprocess.Popen(
            [dask, "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
             "--no-dashboard"], stdout=log, stderr=log)]
        try:
            # A worker started before its scheduler listens waits for it.
            for _ in range(workers):
                processes.append(subprocess.Popen(
                    [dask, "worker", address, "--nworkers", "1", "--nthreads", "1",
                     "--host", "127.0.0.1", "--no-dashboard", *options],
                    stdout=log, stderr=log))
            yield address
        finally:
            # The workers first, each to its end, and the scheduler last: a worker whose
            # scheduler is gone waits for it (a restarted one for 30 s) before it ends.
            for process in reversed(processes):
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    print(f"{process.args[:2]} did not end within 30 s of SIGTERM: killed")
                    process.kill()
                    process.wait(10)
    errors = [line for line in log_path.read_text().splitlines() if "ERROR" in line]
    if errors:
        print(f"{log_path} has {len(errors)} ERROR lines, the first:\n{errors[0]}")


def _loop(ctx: Any, *, lr: float, validation: tuple[np.ndarray, np.ndarray]) -> None:
    """The ``dt.run`` job: the README's loop, its held-out accuracy in each epoch's report."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)  # build_mlp's network, built here: the workers cannot import _common
    model = ctx.prepare(torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.ReLU(),
                                            torch.nn.Linear(100, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    state = ctx.restore()
    if state:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    xv, yv = (torch.from_numpy(a) for a in validation)
    for _ in ctx.epochs():
        for xb, yb in ctx.batches("train", batch_size=128):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
        with torch.no_grad():
            accuracy = float((model.module(xv).argmax(1) == yv).float().mean())
        ctx.report({"accuracy": accuracy},
                   checkpoint={"model": model.module.state_dict(), "opt": opt.state_dict()})


def _job(address: str, strategy: str, workers: int, seconds: float) -> dict[str, Any]:
    X, y = dt.datasets.digits(200_000, seed=0, chunks=10_000)
    Xv, yv = dt.datasets.digits_test()
    stop = [dt.StopAfter(seconds=seconds)]
    with dt.connect(address, quiet=True) as client:
        client.wait_for_workers(workers, timeout=60)
        t0 = time.monotonic()
        if strategy == "dt.run":
            result = dt.run(_loop, data={"train": (X, y)}, workers=(1, workers), epochs=10_000,
                            config={"lr": 1e-3, "validation": (Xv, yv)}, stop=stop,
                            client=client)
        else:
            result = dt.Trainer(build_mlp([100]), strategy=strategy, lr=1e-3,
                                workers=(1, workers), batch_size=128, epochs=10_000,
                                score_every=0.5, progress=False, stop=stop,
                                client=client).fit(X, y, validation=(Xv, yv))
        took = time.monotonic() - t0
    accuracy = float(result.history["accuracy"].dropna().iloc[-1])
    applied = int(result.samples)
    ledger = int(result.ledger["consumed"].sum())
    return {"strategy": strategy, "accuracy": round(accuracy, 4),
            "departures": len(result.departures), "arrivals": len(result.arrivals),
            "left at a start or stop": sum(bool(f.get("notice")) for f in result.failures),
            "failures": len({f["loss"] for f in result.failures if f.get("loss") is not None}),
            "redone": sum(int(d["redone"]) for d in result.departures),
            "samples applied": applied, "in the ledger": ledger,
            "each once": applied == ledger, "seconds": round(took, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="each job's training time")
    parser.add_argument("--lifetime", type=float, default=20.0, help="dask worker --lifetime")
    parser.add_argument("--stagger", type=float, default=5.0,
                        help="dask worker --lifetime-stagger")
    parser.add_argument("--workers", type=int, default=3, help="dask worker programs")
    parser.add_argument("--strategies", default="async-ps,sync,dt.run")
    parser.add_argument("--clusters", default="undisturbed,lifetime",
                        help="which of the two clusters to run each strategy on")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "dt-lifetime",
                        help="directory for each cluster's log (its workers' and scheduler's)")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    lifetime = ["--lifetime", f"{args.lifetime:g}s", "--lifetime-stagger", f"{args.stagger:g}s",
                "--lifetime-restart"]
    rows: list[dict[str, Any]] = []
    for strategy in args.strategies.split(","):
        for name in args.clusters.split(","):
            options = {"undisturbed": [], "lifetime": lifetime}[name]
            # A fresh cluster per job: every job starts with its workers' lifetimes ahead.
            log = args.logs / f"{strategy}-{name}.log"
            with _dask_cluster(args.workers, options, log) as address:
                row = {"cluster": name, **_job(address, strategy, args.workers, args.seconds)}
            rows.append(row)
            print(row, flush=True)
    md = (f"## {args.seconds:g}-s jobs on {args.workers} `dask worker` programs, undisturbed "
          f"and with `--lifetime {args.lifetime:g}s --lifetime-stagger {args.stagger:g}s "
          "--lifetime-restart`\n\n" + markdown_table(rows, list(rows[0])))
    print(md)
    write_results("lifetime", md, {"environment": environment(), "rows": rows,
                                   "args": vars(args)})


if __name__ == "__main__":
    main()
