"""The same hyper-parameter search with ``dt.search`` and with Ray Tune: time to the best score.

Usage::

    python benchmarks/search.py [--n-samples N] [--epochs E] [--trials T] [--quick]

The search, identical on both sides: the digits MLP 64-hidden-10 (Adam, cross entropy), space
``lr`` loguniform(1e-4, 1e-1), ``hidden`` in {32, 64, 128}, ``batch_size`` in {64, 128, 256};
16 trials, 2 at once, ``epochs`` passes over ``n_samples`` generated digits rows each; optuna's
TPE sampler with seed 0; ASHA with rungs at 10%, 30% and 90% of a trial's planned samples keeping
the best third (``dt.search(pruner="asha")``; Ray's ``ASHAScheduler(time_attr="progress",
max_t=1000, grace_period=100, reduction_factor=3)`` on the same per-mille progress); every trial
scores the held-out digits (360 rows) about once a second.

* **dt.search** on ``dt.connect(n_workers=2)``: each trial a ``dt.Trainer`` (async-ps, one trainer,
  one server and a scorer, on one reserved worker), the data generated and persisted on the
  workers once for all trials.
* **Ray Tune** ``ray.init(num_cpus=2)``: each trial a plain torch loop (one thread) in a Ray
  worker, the same data as numpy in Ray's object store (``tune.with_parameters``), the sampler
  through ``OptunaSearch``.

Times count from the start of each search (Ray: from handing the data to Ray), not the start-up
of the cluster or of Ray, reported apart. "Time to target" is when the best score so far first
reached the lower of the two searches' best scores: the time each took to the same score.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import optuna
import torch
from _common import cpu_load, environment, markdown_table, write_results

import dask_train as dt

HIDDEN, BATCH = [32, 64, 128], [64, 128, 256]


def mlp(hidden: int = 64) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def best_so_far(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, best = [], -math.inf
    for t, value in sorted(points):
        best = max(best, value)
        out.append((t, best))
    return out


def time_to(points: list[tuple[float, float]], target: float) -> float:
    return next((t for t, best in best_so_far(points) if best >= target - 1e-12), math.nan)


# -- dt.search ---------------------------------------------------------------------------------------


def run_dt(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    client = dt.connect(n_workers=2, quiet=True)
    startup = time.perf_counter() - started
    try:
        X, y = dt.datasets.digits(n_samples=args.n_samples, chunks=args.chunks, seed=0)
        Xv, yv = dt.datasets.digits_test()
        trainer = dt.Trainer(mlp, strategy="async-ps", workers=1, ps=1, scorer=1,
                             epochs=args.epochs, score_every=1.0, timeout=120, client=client)
        space = {"lr": dt.loguniform(1e-4, 1e-1), "hidden": HIDDEN, "batch_size": BATCH}
        with cpu_load() as load:
            result = dt.search(trainer, space, X, y, validation=(Xv, yv), n_trials=args.trials,
                               max_concurrent=2, sampler=optuna.samplers.TPESampler(seed=0),
                               pruner="asha", progress=False, client=client)
    finally:
        client.close()
    points = [p for r in result.records for p in r.points]
    states = result.trials["state"].value_counts().to_dict()
    return {"runner": "dt.search", "startup_s": startup, "wall_s": result.wall_s,
            "best": result.best_score, "best_params": result.best_params, "points": points,
            "states": states, "other_load": load.foreign}


# -- Ray Tune ----------------------------------------------------------------------------------------


def _evaluate(net: torch.nn.Module, Xv: np.ndarray, yv: np.ndarray) -> float:
    with torch.no_grad():
        return float((net(torch.from_numpy(Xv)).argmax(dim=1).numpy() == yv).mean())


def ray_trial(config: dict[str, Any], data: Any = None) -> None:
    from ray import tune

    from dask_train.tuning._trial import progress_step

    torch.set_num_threads(1)
    X, y, Xv, yv, epochs = data
    torch.manual_seed(0)
    net = mlp(config["hidden"])
    opt = torch.optim.Adam(net.parameters(), lr=config["lr"])
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)
    planned, seen, rng = epochs * len(X), 0, np.random.default_rng(0)
    next_score = time.time() + 1.0
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(X)))
        for i in range(0, len(X), config["batch_size"]):
            idx = order[i : i + config["batch_size"]]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(Xt[idx]), yt[idx]).backward()
            opt.step()
            seen += len(idx)
            if time.time() >= next_score:
                next_score = time.time() + 1.0
                tune.report({"accuracy": _evaluate(net, Xv, yv),
                             "progress": progress_step(seen, planned), "t": time.time()})
    tune.report({"accuracy": _evaluate(net, Xv, yv), "progress": 1000, "t": time.time()})


def run_ray(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    X, y = (np.asarray(a) for a in dt.datasets.digits(n_samples=args.n_samples,
                                                        chunks=args.chunks, seed=0))
    X, y = X.compute() if hasattr(X, "compute") else X, y
    Xv, yv = dt.datasets.digits_test()
    started = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    startup = time.perf_counter() - started
    try:
        with cpu_load() as load, tempfile.TemporaryDirectory() as storage:
            t0 = time.time()
            trainable = tune.with_resources(
                tune.with_parameters(ray_trial, data=(X, y, Xv, yv, args.epochs)), {"cpu": 1})
            tuner = tune.Tuner(
                trainable,
                param_space={"lr": tune.loguniform(1e-4, 1e-1), "hidden": tune.choice(HIDDEN),
                             "batch_size": tune.choice(BATCH)},
                tune_config=tune.TuneConfig(
                    metric="accuracy", mode="max", num_samples=args.trials,
                    max_concurrent_trials=2,
                    search_alg=OptunaSearch(sampler=optuna.samplers.TPESampler(seed=0)),
                    scheduler=ASHAScheduler(time_attr="progress", max_t=1000, grace_period=100,
                                            reduction_factor=3)),
                run_config=tune.RunConfig(storage_path=storage, verbose=0))
            grid = tuner.fit()
            wall = time.time() - t0
    finally:
        ray.shutdown()
    points, states = [], {"complete": 0, "pruned": 0, "failed": 0}
    for result in grid:
        frame = result.metrics_dataframe
        if result.error is not None or frame is None or frame.empty:
            states["failed"] += 1
            continue
        points += [(float(t) - t0, float(a)) for t, a in zip(frame["t"], frame["accuracy"])]
        states["complete" if int(frame["progress"].iloc[-1]) >= 1000 else "pruned"] += 1
    best = grid.get_best_result(metric="accuracy", mode="max")
    return {"runner": "Ray Tune", "startup_s": startup, "wall_s": wall,
            "best": float(best.metrics["accuracy"]), "best_params": best.config,
            "points": points, "states": states, "other_load": load.foreign}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=200_000)
    parser.add_argument("--chunks", type=int, default=25_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="20,000 rows, 4 trials, 1 epoch")
    args = parser.parse_args(argv)
    if args.quick:
        args.n_samples, args.chunks, args.trials, args.epochs = 20_000, 5_000, 4, 1
    runs = [run_dt(args), run_ray(args)]
    target = min(r["best"] for r in runs)
    rows = []
    for r in runs:
        r["time_to_target_s"] = time_to(r["points"], target)
        rows.append({"runner": r["runner"], "best accuracy": f"{r['best']:.4f}",
                     "time to target": f"{r['time_to_target_s']:.1f} s",
                     "search wall": f"{r['wall_s']:.1f} s", "start-up": f"{r['startup_s']:.1f} s",
                     "trials (complete/pruned/failed)": "/".join(
                         str(r["states"].get(k, 0)) for k in ("complete", "pruned", "failed")),
                     "other load (cores)": f"{r['other_load']:.2f}"})
        print(f"{r['runner']:<10} best {r['best']:.4f} {r['best_params']}", flush=True)
    columns = ["runner", "best accuracy", "time to target", "search wall", "start-up",
               "trials (complete/pruned/failed)", "other load (cores)"]
    table = markdown_table(rows, columns)
    env = environment()
    print(f"\ntarget (the lower best score): {target:.4f}\n")
    print(table)
    markdown = (f"# dt.search vs Ray Tune ({'quick' if args.quick else 'full'})\n\n"
                f"{args.trials} trials, 2 at once, {args.n_samples:,} rows x {args.epochs} "
                f"epochs; target accuracy {target:.4f}\n\n{table}\n\nEnvironment: {env}\n")
    write_results("search-quick" if args.quick else "search", markdown,
                  {"runs": runs, "target": target, "args": vars(args), "env": env})
    return 0


if __name__ == "__main__":
    sys.exit(main())
