"""Throughput per interval of one job: does a job's samples/s hold from its start to its end?

Usage::

    python benchmarks/throughput_intervals.py [--seconds 60] [--interval 5] [--n-samples N]
        [--models MLP,CNN,transformer] [--strategies async-ps,sync] [--flush on,off]

For each model of ``models.side_by_side()`` named in ``--models`` (default the MLP
64-1024-1024-10; also the CNN and the token transformer; Adam 1e-3, batch 128 per trainer,
digits), trains ``strategy="async-ps"`` (ps=1, workers=2) and ``strategy="sync"`` (2 ranks) on
``dt.connect(n_workers=2)``, each with denormals flushed (the default) and with the Dask config
``dask-train.flush-denormal: false`` on the workers (``--flush``), for ``--seconds`` each, scored
every second; prints the samples/s of each
``--interval``-second interval of ``result.history`` and the ratio of the last 10 s to the 5-15 s
stretch (issue 57 asks for >= 0.9). Why per interval: a job whose steps slow down after 20 s
(denormals in the optimizer's state, 40% on async-ps) shows a fine mean over a short run.

Each model first runs as plain torch (2 threads, denormals flushed as the roles flush them) for
the same ``--seconds`` in this process, before the cluster starts, its samples/s per interval
printed the same way (``--plain off`` leaves it out): a machine whose own speed drifts (a
virtual machine's neighbours) shows it there too, so a job's drift can be told from the
machine's. Each row also says how much of the cores other programs used meanwhile ("other
load"). Printed, never asserted: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dask
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_load  # noqa: E402
from throughput import shuffled_batches, train_steps  # noqa: E402

import dask_train as dt  # noqa: E402
from models import side_by_side  # noqa: E402


def _set_flag(value: bool, dask_worker: Any = None) -> None:
    dask.config.set({"dask-train.flush-denormal": value})


def intervals(history: Any, width: float) -> list[tuple[float, float]]:
    """(interval start in s, samples/s in it) from ``result.history`` (rows of time_s, samples)."""
    t = np.asarray(history["time_s"], dtype=float)
    s = np.asarray(history["samples"], dtype=float)
    out = []
    for start in np.arange(0.0, t.max() if len(t) else 0.0, width):
        inside = (t >= start) & (t <= start + width)
        if inside.sum() >= 2:
            idx = np.flatnonzero(inside)
            a, b = idx[0], idx[-1]
            if t[b] > t[a]:
                out.append((float(start), float((s[b] - s[a]) / (t[b] - t[a]))))
    return out


def rate_between(history: Any, lo: float, hi: float) -> float:
    t = np.asarray(history["time_s"], dtype=float)
    s = np.asarray(history["samples"], dtype=float)
    idx = np.flatnonzero((t >= lo) & (t <= hi))
    if len(idx) < 2 or t[idx[-1]] <= t[idx[0]]:
        return float("nan")
    return float((s[idx[-1]] - s[idx[0]]) / (t[idx[-1]] - t[idx[0]]))


def plain_history(make: Any, X: torch.Tensor, y: torch.Tensor, *, seconds: float,
                  every: float = 1.0) -> dict[str, list[float]]:
    """Plain torch (2 threads, denormals flushed) for ``seconds`` from a fresh model: a row of
    (time_s, samples) about every ``every`` seconds, as a job's history has them."""
    from dask_train.runtime._denormals import flushed

    torch.set_num_threads(2)
    net = make()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    batches = shuffled_batches(X, y, 128)
    rows: dict[str, list[float]] = {"time_s": [0.0], "samples": [0.0]}
    with flushed(True):
        samples, started, mark = 0, time.perf_counter(), 0.0
        while (now := time.perf_counter() - started) < seconds:
            samples += train_steps(net, opt, batches, 5)
            if now - mark >= every:
                mark = now
                rows["time_s"].append(now)
                rows["samples"].append(float(samples))
    return rows


def report(name: str, runner: str, history: Any, *, width: float, other: float) -> None:
    """One printed row: samples/s per interval, the last 10 s against 5-15 s, other load."""
    end = float(np.max(history["time_s"]))
    early, late = rate_between(history, 5, 15), rate_between(history, end - 10, end)
    rates = " ".join(f"{r / 1e3:.1f}k" for _, r in intervals(history, width))
    print(f"{name} | {runner} | samples/s per {width:g} s: {rates} | last 10 s / 5-15 s: "
          f"{late / early:.2f} | other load {other:.2f} cores", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--n-samples", type=int, default=300_000)
    parser.add_argument("--strategies", default="async-ps,sync")
    parser.add_argument("--models", default="MLP", help="comma-separated substrings of "
                        "models.side_by_side()'s names: MLP, CNN, transformer")
    parser.add_argument("--flush", default="on,off", help="flush-denormal settings to run")
    parser.add_argument("--plain", default="on", choices=("on", "off"),
                        help="plain torch per interval first, as the machine's own reference")
    args = parser.parse_args(argv)
    chosen = {k: v for k, v in side_by_side().items()
              if any(m.strip() and m.strip() in k for m in args.models.split(","))}
    flags = [f.strip() == "on" for f in args.flush.split(",")]
    if args.plain == "on":  # before the cluster exists: its workers would share the cores
        x_np, y_np = dask.compute(*dt.datasets.digits(args.n_samples, seed=0))
        threads = torch.get_num_threads()
        for name, (make, shape) in chosen.items():
            with cpu_load() as load:
                rows = plain_history(make, torch.from_numpy(x_np.reshape(-1, *shape)),
                                     torch.from_numpy(y_np), seconds=args.seconds)
            report(name, "torch, 2 threads | flush-denormal=on", rows, width=args.interval,
                   other=load.foreign)
        torch.set_num_threads(threads)
    client = dt.connect(n_workers=2, quiet=True)
    X, y = client.persist(list(dt.datasets.digits(args.n_samples, seed=0)))
    xv, yv = dt.datasets.digits_test()
    for name, (make, shape) in chosen.items():
        for strategy in args.strategies.split(","):
            for flush in flags:
                client.run(_set_flag, flush)
                with cpu_load() as load:
                    result = dt.Trainer(make(), optimizer="adam", lr=1e-3, strategy=strategy,
                        ps=1, workers=2, batch_size=128, epochs=1000, score_every=1.0,
                        progress=False, client=client,
                        stop=[dt.StopAfter(seconds=args.seconds)]).fit(
                        X.reshape(-1, *shape), y, validation=(xv.reshape(-1, *shape), yv))
                # The last row is the score taken after the stop (its time is not training
                # time).
                report(name, f"{strategy} | flush-denormal={'on' if flush else 'off'}",
                       result.history.iloc[:-1], width=args.interval, other=load.foreign)
    client.run(_set_flag, True)
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
