"""Time to accuracy, start-up included: script start to a model that is good enough.

Usage::

    python benchmarks/time_to_accuracy.py [--repeats 3]
                                          [--systems torch1,torch2,ddp,async-ps,sync,dt-run]
                                          [--with-ray] [--quick]

The job (the same for every system): the digits inflated to 1.1M rows (``dt.datasets.digits``,
seed 0), stored as 22 ``.npy`` files of 50,000 rows (written once, before any timing); an MLP
64-100-10; Adam, lr 1e-3; cross entropy; a global batch of 128 rows (64 per process for the
two-process systems); held-out accuracy 0.97 on the untouched test split (360 images), scored
every 0.5 s; shuffled each epoch.

Each system runs in a fresh Python process, one after the other, timed from the moment the
process is started (interpreter, imports, cluster start, data loading, training, scoring) until
the held-out accuracy first reaches 0.97; ``setup`` is the time until its first training step.
The systems:

* ``torch1``, ``torch2``: one plain torch process with 1 or 2 threads, loading the files with
  ``np.load`` and training on shuffled in-memory batches of 128.
* ``ddp``: a hand-written ``DistributedDataParallel`` job, 2 processes started with
  ``torch.multiprocessing`` (gloo), each loading half of the files, one thread each, batches of
  64; rank 0 scores every 0.5 s and the ranks agree to stop with a one-element all-reduce.
* ``async-ps``, ``sync``: ``dt.connect(n_workers=2)``, ``dt.from_npy``, and ``dt.Trainer`` with
  ``global_batch_size=128`` on 2 trainers, ``score_every=0.5``, ``StopAtScore("accuracy", 0.97)``
  (async-ps: 1 parameter server; the defaults otherwise).
* ``dt-run``: ``dt.run`` with the hand-written DDP runner's loop as a user would port it: the
  model through ``ctx.prepare`` (DDP), batches of 64 from ``ctx.batches`` (``dt.from_npy``
  blocks, each rank its share), every 100 batches rank 0 scores and every rank calls
  ``ctx.report``; ``StopAtScore("accuracy", 0.97)`` stops the job.
* ``ray`` (``--with-ray``): Ray Train's ``TorchTrainer``, 2 CPU workers, each reading half of the
  files, batches of 64, rank 0 scoring every 0.5 s.

For dask-train, "trainers waiting" is the share of the trainers' loop spent waiting for the
parameter servers (async-ps) or the all-reduce (sync), summed over the trainers.

Medians and ranges over ``--repeats`` runs are printed and written to
``results/time-to-accuracy.md``; nothing is asserted. Aims: async-ps reaches 0.97 in at most
1.0x plain torch's time with 2 threads, sync in at most 0.8x the hand-written DDP's, and
``dt.run`` no slower than the hand-written DDP and at least 2x faster than Ray Train.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TARGET, SCORE_EVERY, LR, GLOBAL_BATCH = 0.97, 0.5, 1e-3, 128
SYSTEMS = ("torch1", "torch2", "ddp", "async-ps", "sync", "dt-run")
REPORT_EVERY = 100  # batches between dt.run reports (about SCORE_EVERY s of a rank's training)


# -- the data, written once ------------------------------------------------------------------------
def write_data(directory: Path, n_samples: int, block: int) -> list[Path]:
    """The inflated digits as ``.npy`` files of ``block`` rows (X and y each)."""
    import numpy as np

    import dask_train as dt

    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / f"done-{n_samples}-{block}"
    files = sorted(directory.glob("x-*.npy"))
    if marker.exists():
        return files
    X, y = dt.datasets.digits(n_samples, seed=0, chunks=block)
    import dask

    for i, (xb, yb) in enumerate(zip(X.to_delayed().ravel(), y.to_delayed().ravel())):
        xa, ya = dask.compute(xb, yb, scheduler="threads")
        np.save(directory / f"x-{i:03d}.npy", np.ascontiguousarray(xa, dtype=np.float32))
        np.save(directory / f"y-{i:03d}.npy", np.ascontiguousarray(ya, dtype=np.int64))
    marker.write_text("ok")
    return sorted(directory.glob("x-*.npy"))


def _report(**values: Any) -> None:
    print("RESULT " + json.dumps(values), flush=True)


# -- the systems (each runs in its own process, started by main) ------------------------------------
def _mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))


def run_torch(data: Path, threads: int, limit_s: float) -> None:
    """One plain process: the reference a distributed system is measured against."""
    import numpy as np
    import torch

    import dask_train as dt  # the held-out split: dt.datasets.digits_test, as every system

    torch.set_num_threads(threads)
    xs = [np.load(p) for p in sorted(data.glob("x-*.npy"))]
    ys = [np.load(p) for p in sorted(data.glob("y-*.npy"))]
    X, Y = torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))
    xv, yv = (torch.from_numpy(a) for a in dt.datasets.digits_test())
    net = _mlp()
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    first, steps, due, deadline = None, 0, 0.0, time.time() + limit_s
    gen = torch.Generator().manual_seed(0)
    while time.time() < deadline:
        order = torch.randperm(len(X), generator=gen)
        for i in range(0, len(X), GLOBAL_BATCH):
            idx = order[i : i + GLOBAL_BATCH]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(X[idx]), Y[idx]).backward()
            opt.step()
            steps += 1
            first = first or time.time()
            if time.time() >= due:
                due = time.time() + SCORE_EVERY
                with torch.no_grad():
                    acc = float((net(xv).argmax(1) == yv).float().mean())
                if acc >= TARGET:
                    _report(first_step=first, target=time.time(), accuracy=acc, steps=steps)
                    return
            if time.time() > deadline:
                break
    _report(first_step=first, target=None, accuracy=None, steps=steps)


def _rank_loop(rank: int, world: int, data: str, net: Any, deadline: float) -> dict[str, Any]:
    """A data-parallel rank's loop over its share of the files (rank::world), the model already
    wrapped for all-reduce (DDP, or Ray's prepare_model); rank 0 scores every SCORE_EVERY s and
    every rank learns at the same step whether to stop. Returns rank 0's result."""
    import numpy as np
    import torch

    import dask_train as dt

    files = sorted(Path(data).glob("x-*.npy"))[rank::world]
    X = torch.from_numpy(np.concatenate([np.load(p) for p in files]))
    Y = torch.from_numpy(np.concatenate([np.load(str(p).replace("x-", "y-")) for p in files]))
    xv, yv = (torch.from_numpy(a) for a in dt.datasets.digits_test())
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(rank)
    half, flag = GLOBAL_BATCH // world, torch.zeros(1)
    first, steps, due, acc = None, 0, 0.0, None
    while True:
        order = torch.randperm(len(X), generator=gen)
        for i in range(0, len(X) - half + 1, half):
            idx = order[i : i + half]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(X[idx]), Y[idx]).backward()
            opt.step()
            steps += 1
            first = first or time.time()
            flag.zero_()
            if rank == 0 and time.time() >= due:
                due = time.time() + SCORE_EVERY
                with torch.no_grad():
                    acc = float((net.module(xv).argmax(1) == yv).float().mean())
                flag[0] = 1.0 if acc >= TARGET or time.time() > deadline else 0.0
            torch.distributed.all_reduce(flag)  # every rank learns at this step whether to stop
            if flag[0] > 0:
                return {"first_step": first, "target": time.time() if acc and acc >= TARGET
                        else None, "accuracy": acc, "steps": steps}


def _ddp_rank(rank: int, port: int, data: str, limit_s: float, out: Any) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    result = _rank_loop(rank, 2, data, DistributedDataParallel(_mlp()), time.time() + limit_s)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def run_ddp(data: Path, limit_s: float) -> None:
    """A hand-written two-process DistributedDataParallel job (gloo)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ddp_rank, args=(r, port, str(data), limit_s, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=limit_s + 120)
    for p in procs:
        p.join(timeout=60)
    _report(**result)


def run_dask_train(data: Path, strategy: str, limit_s: float) -> None:
    """dask-train on its embedded cluster: what a user's script does."""
    import torch  # noqa: F401  (the user's script imports it to build the model)

    import dask_train as dt

    client = dt.connect(n_workers=2, quiet=True)
    X = dt.from_npy(sorted(data.glob("x-*.npy")))
    y = dt.from_npy(sorted(data.glob("y-*.npy")))
    trainer = dt.Trainer(_mlp(), strategy=strategy, ps=1, workers=2, lr=LR, optimizer="adam",
                         global_batch_size=GLOBAL_BATCH, epochs=20, score_every=SCORE_EVERY,
                         stop=[dt.StopAtScore("accuracy", TARGET), dt.StopAfter(seconds=limit_s)],
                         progress=False, client=client)
    result = trainer.fit(X, y, validation=dt.datasets.digits_test())
    t = result.timings
    reached = result.stopped_by.startswith("StopAtScore")
    hit = result.history[result.history["accuracy"] >= TARGET]
    target = result.started_at + float(hit["time_s"].iloc[0]) if reached and len(hit) else None
    # The share of the trainers' loop spent waiting for the servers (async-ps) or the all-reduce.
    busy = sum(r.get("busy_s", 0.0) for r in result.trainers)
    waited = sum(r.get("ps_wait_s", r.get("allreduce_s", 0.0)) for r in result.trainers)
    _report(first_step=result.started_at + t["roles"] + t["first_step"], target=target,
            accuracy=float(result.history["accuracy"].max()), steps=result.steps, timings=t,
            wait_share=waited / busy if busy else None)
    client.close()


def _dt_run_loop(ctx: Any, deadline: float) -> dict[str, Any]:
    """The DDP runner's loop under dt.run: ctx.batches instead of each rank's files, and
    ctx.report (every rank, every REPORT_EVERY batches) instead of the stop all-reduce."""
    import torch

    torch.set_num_threads(1)
    net = ctx.prepare(_mlp())
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    xv, yv = ctx.dataset("val")
    first = None
    for _ in ctx.epochs(1000):
        for i, (xb, yb) in enumerate(ctx.batches(batch_size=GLOBAL_BATCH // ctx.world_size)):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
            first = first or time.time()
            if i % REPORT_EVERY == REPORT_EVERY - 1:
                acc = None
                if ctx.rank == 0:
                    with torch.no_grad():
                        acc = float((net.module(xv).argmax(1) == yv).float().mean())
                ctx.report({"accuracy": acc} if acc is not None else {})
                if ctx.should_stop() or time.time() > deadline:
                    break
        if ctx.should_stop() or time.time() > deadline:
            break
    return {"first_step": first}


def run_dt_run(data: Path, limit_s: float) -> None:
    """dt.run on the embedded cluster: the user's own loop."""
    import torch  # noqa: F401

    import dask_train as dt

    client = dt.connect(n_workers=2, quiet=True)
    X = dt.from_npy(sorted(data.glob("x-*.npy")))
    y = dt.from_npy(sorted(data.glob("y-*.npy")))
    result = dt.run(_dt_run_loop, workers=2, client=client,
                    data={"train": (X, y), "val": dt.datasets.digits_test()},
                    config={"deadline": time.time() + limit_s},
                    stop=[dt.StopAtScore("accuracy", TARGET), dt.StopAfter(seconds=limit_s)])
    hist = result.history
    hit = hist[hist["accuracy"] >= TARGET] if "accuracy" in hist else hist.iloc[:0]
    _report(first_step=result.returns[0]["first_step"],
            target=result.started_at + float(hit["time_s"].iloc[0]) if len(hit) else None,
            accuracy=float(hist["accuracy"].max()) if len(hist) else None, steps=result.steps,
            timings=result.timings)
    client.close()


def _ray_loop(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    net = ray.train.torch.prepare_model(_mlp())
    result = _rank_loop(rank, world, config["data"], net, config["deadline"])
    # Rank 0 writes its result to a file: ray.train.report is collective in Train v2 (one rank
    # reporting alone hung) and kept no metrics here (result.metrics: None).
    if rank == 0:
        Path(config["out"]).write_text(json.dumps(result))


def run_ray(data: Path, limit_s: float) -> None:
    """Ray Train's TorchTrainer with 2 CPU workers."""
    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    out = Path(tempfile.mkdtemp()) / "ray-result.json"
    config = {"data": str(data), "deadline": time.time() + limit_s, "out": str(out)}
    trainer = TorchTrainer(_ray_loop, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False))
    trainer.fit()
    _report(**json.loads(out.read_text()))
    ray.shutdown()


def child(system: str, data: Path, limit_s: float) -> None:
    """Run one system in this process (started by main)."""
    if system in ("torch1", "torch2"):
        run_torch(data, int(system[-1]), limit_s)
    elif system == "ddp":
        run_ddp(data, limit_s)
    elif system == "ray":
        run_ray(data, limit_s)
    elif system == "dt-run":
        run_dt_run(data, limit_s)
    else:
        run_dask_train(data, system, limit_s)


# -- the driver -------------------------------------------------------------------------------------
def time_one(system: str, data: Path, limit_s: float) -> dict[str, Any]:
    """Start ``system`` in a fresh process; seconds from its start to its first step and to 0.97."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    started = time.time()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", system,
                           "--data", str(data), "--limit", str(limit_s)],
                          capture_output=True, text=True, timeout=limit_s + 300, env=env)
    ended = time.time()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"system": system, "error": (proc.stderr or proc.stdout)[-1500:]}
    got = json.loads(lines[-1][len("RESULT "):])
    first, target = got.get("first_step"), got.get("target")
    return {"system": system, "setup_s": first - started if first else None,
            "to_target_s": target - started if target else None, "process_s": ended - started,
            "accuracy": got.get("accuracy"), "steps": got.get("steps"),
            "timings": got.get("timings"), "wait_share": got.get("wait_share")}


def _summary(runs: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return "not reached"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--with-ray", action="store_true", help="also time Ray Train")
    parser.add_argument("--limit", type=float, default=180.0, help="seconds per run at most")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "dt-tta-digits")
    parser.add_argument("--quick", action="store_true", help="1 repeat, 200k rows (a smoke test)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.data, args.limit)
        return 0
    sys.path.insert(0, str(HERE))
    from _common import environment, markdown_table, write_results

    n_samples = 200_000 if args.quick else 1_100_000
    data = args.data / str(n_samples)
    write_data(data, n_samples, 50_000)
    systems = [s for s in args.systems.split(",") if s] + (["ray"] if args.with_ray else [])
    repeats = 1 if args.quick else args.repeats
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r in range(repeats):  # interleaved, so a slow minute of the machine hits every system
        for system in systems:
            run = time_one(system, data, args.limit)
            runs[system].append(run)
            shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in run.items()
                     if k not in ("timings", "error")}
            print(f"repeat {r + 1}/{repeats} {system}: {shown}"
                  + (f" ERROR {run['error'][-300:]}" if "error" in run else ""), flush=True)
    names = {"torch1": "plain torch, 1 thread", "torch2": "plain torch, 2 threads",
             "ddp": "hand-written DDP, 2 processes (gloo)", "async-ps": "dask-train async-ps",
             "sync": "dask-train sync", "ray": "Ray Train, 2 workers",
             "dt-run": "dask-train dt.run (the DDP loop, ported)"}
    rows = [{"system": names[s], "setup (s)": _summary(runs[s], "setup_s"),
             f"script start to {TARGET} (s)": _summary(runs[s], "to_target_s"),
             "trainers waiting (%)": _summary([{"w": 100 * r["wait_share"]} for r in runs[s]
                                               if r.get("wait_share") is not None], "w")
             if s in ("async-ps", "sync") else "",
             "runs": len(runs[s]), "failed": sum("error" in r for r in runs[s])}
            for s in systems]
    table = markdown_table(rows, list(rows[0]))
    print(table)
    med = {s: statistics.median([r["to_target_s"] for r in runs[s] if r.get("to_target_s")] or
                                [float("nan")]) for s in systems}
    notes = []
    best = min((s for s in ("async-ps", "sync") if s in med), key=lambda s: med[s], default=None)
    if best and "torch2" in med:
        notes.append(f"dask-train {best} / plain torch 2 threads: {med[best] / med['torch2']:.2f}x")
    if best and "ddp" in med:
        notes.append(f"dask-train {best} / hand-written DDP: {med[best] / med['ddp']:.2f}x")
    if "dt-run" in med and "ddp" in med:
        notes.append(f"dt.run / hand-written DDP: {med['dt-run'] / med['ddp']:.2f}x")
    if "dt-run" in med and "ray" in med:
        notes.append(f"Ray Train / dt.run: {med['ray'] / med['dt-run']:.2f}x")
    print("\n".join(notes))
    dt_timings = {s: [r.get("timings") for r in runs[s]] for s in ("async-ps", "sync") if s in runs}
    write_results("time-to-accuracy" + ("-quick" if args.quick else ""),
                  table + "\n\n" + "\n".join(notes),
                  {"environment": environment(), "runs": runs, "timings": dt_timings,
                   "n_samples": n_samples})
    return 0


if __name__ == "__main__":
    sys.exit(main())
