"""Soak: many rounds of every kind of job on one cluster, reading each worker after each round.

A long-lived cluster runs job after job in the same worker processes. Each round here runs an
async-ps fit, a sync fit, a ``dt.run`` job and a ``dt.predict`` on one embedded 2-worker cluster
(the digits, MLP 64-256-10, one epoch of 20k rows each: about a second a job), then reads every
worker: descriptors by kind, the ``/dev/shm`` files they hold, threads, resident memory (RSS), and
RSS once more after ``malloc_trim(0)`` (what glibc's allocator keeps of freed memory for reuse,
not live objects). It prints one row per round and, at the end, the growth per round after the
warm-up rounds.

    python benchmarks/soak.py --rounds 250        # 1,000 jobs
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import dask
import numpy as np
import torch

import dask_train as dt
from dask_train.bench._resources import process_resources, scheduler_tasks, scheduler_topics, trim_malloc


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _loop(ctx: Any) -> None:
    model = ctx.prepare(_net())
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    for xb, yb in ctx.batches():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    ctx.report({"loss": 0.0})


def _round(client: Any, X: Any, y: Any, validation: Any) -> None:
    model = None
    for strategy in ("async-ps", "sync"):
        model = dt.Trainer(_net(), strategy=strategy, workers=2, epochs=1, batch_size=128,
                           progress=False, client=client).fit(X, y, validation=validation).model
    dt.run(_loop, data={"train": (X, y)}, workers=2, epochs=1, batch_size=128, client=client)
    dt.predict(model, X).compute()


def _slope(xs: list[float], ys: list[float]) -> float:
    return float(np.polyfit(xs, ys, 1)[0]) if len(xs) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25, help="rounds of 4 jobs (default 25)")
    parser.add_argument("--warmup", type=int, default=10,
                        help="rounds left out of the growth per round (default 10)")
    parser.add_argument("--no-profile", action="store_true",
                        help="turn Dask's statistical profiler off on the workers "
                        "(distributed.worker.profile.enabled): its history of one profile a "
                        "second, kept for an hour, is most of a young worker's growth")
    args = parser.parse_args()
    if args.no_profile:
        dask.config.set({"distributed.worker.profile.enabled": False})
    client = dt.connect(n_workers=2)
    X, y = dt.datasets.digits(n_samples=20_000, seed=0)
    validation = dt.datasets.digits_test()
    rows: list[dict[str, Any]] = []
    started = time.time()
    print("| round | jobs | worker | fds (socket, pipe, anon, file) | /dev/shm fds | threads | "
          "RSS MB | RSS MB after malloc_trim | modules | Python blocks (k) | scheduler tasks | "
          "scheduler's dask-train topics (events) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        _round(client, X, y, validation)
        seen = client.run(process_resources)
        trimmed = client.run(trim_malloc)
        tasks = client.run_on_scheduler(scheduler_tasks)
        topics = client.run_on_scheduler(scheduler_topics)
        for i, (address, rec) in enumerate(sorted(seen.items())):
            fds = rec["fds"]
            row = {"round": r, "worker": i, "fds": sum(fds.values()), "shm": fds.get("shm", 0),
                   "threads": rec["threads"], "rss": rec["rss_mb"], "trimmed": trimmed[address],
                   "modules": rec["modules"], "blocks": rec["py_blocks"] / 1000}
            rows.append(row)
            print(f"| {r} | {4 * (r + 1)} | {i} | {row['fds']} ({fds.get('socket', 0)}, "
                  f"{fds.get('pipe', 0)}, {fds.get('anon_inode', 0)}, {fds.get('file', 0)}) | "
                  f"{row['shm']} | {row['threads']} | {row['rss']:.0f} | {row['trimmed']:.0f} | "
                  f"{row['modules']} | {row['blocks']:.0f} | {tasks} | {len(topics)} "
                  f"({sum(topics.values())}) |", flush=True)
    print(f"\n{4 * args.rounds} jobs in {time.time() - started:.0f} s; growth per round after "
          f"round {args.warmup} (least-squares slope):")
    print("| worker | fds | /dev/shm fds | threads | RSS MB | RSS MB after malloc_trim | modules | "
          "Python blocks (k) |")
    print("|---|---|---|---|---|---|---|---|")
    for i in sorted({row["worker"] for row in rows}):
        mine = [row for row in rows if row["worker"] == i and row["round"] >= args.warmup]
        xs = [float(row["round"]) for row in mine]
        print(f"| {i} | " + " | ".join(f"{_slope(xs, [float(row[k]) for row in mine]):+.3f}"
                                       for k in ("fds", "shm", "threads", "rss", "trimmed",
                                                 "modules", "blocks"))
              + " |")
    client.close()


if __name__ == "__main__":
    main()
