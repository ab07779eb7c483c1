"""Synchronous training throughput: ``Trainer(strategy="sync")`` against hand-written DDP.

Usage::

    python benchmarks/sync.py [--n-samples N] [--seconds S] [--score-every S] [--quick]

Measured in one run, in samples per second, for the two MLPs of ``throughput.py`` (64-100-10 at
batch 512, 64-1024-1024-10 at batch 128; Adam lr 1e-3, cross entropy, digits data):

* **hand-written DDP**: two processes started with ``torch.multiprocessing``, gloo on loopback,
  ``DistributedDataParallel`` over the model, one torch thread each, each rank reading its half
  of the same data in shuffled batches of the same size; a fixed number of steps is timed after
  a warm-up. Throughput counts both ranks' samples (the global batch is 2x the batch size, as in
  the Trainer).
* **Trainer** ``strategy="sync", workers=2`` on ``dt.connect(n_workers=2)``, steady state: the
  rate between the first and last score taken during training, with the defaults on the data in
  16 blocks, with ``grad_accumulation=4`` (one all-reduce per 4 batches), and with the data in 4
  larger blocks (the controller's cost per block: one feed task and one event). The scorer
  (every ``--score-every`` seconds, 2 by default) shares the two cores with the ranks and DDP does
  no scoring at all: on the large MLP, scoring every 0.5 s instead of 2 s cost about 10% of the
  rate here.

"Time waiting for the all-reduce" is each rank's time blocked on its collectives after its
backward pass: the part of the communication that the overlap with backward did not hide.

The aim is >= 1.0x the hand-written DDP. Ratios are printed, never asserted. The DDP processes
run before the Dask cluster starts, so the two never share the cores.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import dask
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import build_mlp, environment, markdown_table, write_results
from torch.nn.parallel import DistributedDataParallel

import dask_train as dt

CASES = (("MLP 64-100-10", (100,), 512, 1.0), ("MLP 64-1024-1024-10", (1024, 1024), 128, 1 / 8))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ddp_rank(rank: int, port: int, x: np.ndarray, y: np.ndarray, hidden: Sequence[int],
              batch: int, seconds: float, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    net = DistributedDataParallel(build_mlp(hidden))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    X, Y = torch.from_numpy(x[rank::2].copy()), torch.from_numpy(y[rank::2].copy())
    gen = torch.Generator().manual_seed(rank)

    def steps(n: int) -> None:
        for _ in range(n):
            idx = torch.randint(0, len(X), (batch,), generator=gen)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(X[idx]), Y[idx]).backward()
            opt.step()

    steps(5)
    started = time.perf_counter()
    steps(20)
    # Both ranks must run the same number of steps: rank 0 decides it and broadcasts it.
    n = torch.tensor([max(20, int(seconds / ((time.perf_counter() - started) / 20)))])
    dist.broadcast(n, src=0)
    dist.barrier()
    started = time.perf_counter()
    steps(int(n))
    dist.barrier()
    if rank == 0:
        out.put((int(n) * batch * 2, time.perf_counter() - started))
    dist.destroy_process_group()


def hand_written_ddp(x: np.ndarray, y: np.ndarray, hidden: Sequence[int], batch: int,
                     seconds: float) -> tuple[int, float]:
    """Samples and seconds of a timed two-process DDP run."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_ddp_rank, args=(_free_port(), x, y, hidden, batch, seconds, out),
                       nprocs=2, start_method="spawn", join=True)
    return out.get(timeout=10)


def trainer_sync(client: Any, X: Any, y: Any, hidden: Sequence[int], batch: int, seconds: float,
                 score_every: float = 2.0, **kwargs: Any) -> tuple[int, float, dt.FitResult]:
    trainer = dt.Trainer(build_mlp(hidden), strategy="sync", optimizer="adam", lr=1e-3, workers=2,
                         scorer=1, batch_size=batch, epochs=10_000, score_every=score_every,
                         stop=[dt.StopAfter(seconds=seconds)], progress=False, client=client,
                         **kwargs)
    result = trainer.fit(X, y, validation=dt.datasets.digits_test())
    history = result.history.iloc[:-1]
    history = history[history["samples"] < result.samples]
    first, last = history.iloc[0], history.iloc[-1]
    return int(last["samples"] - first["samples"]), float(last["time_s"] - first["time_s"]), result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--score-every", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    seconds = 3.0 if args.quick else args.seconds
    score_every = 0.5 if args.quick else args.score_every
    n = 40_000 if args.quick else args.n_samples
    data = {name: dt.datasets.digits(max(2_000, int(n * f)), seed=0,
                                     chunks=math.ceil(max(2_000, int(n * f)) / 16))
            for name, _, _, f in CASES}
    rows: list[dict[str, Any]] = []
    for name, hidden, batch, _ in CASES:
        x, y = dask.compute(*data[name])
        samples, secs = hand_written_ddp(x, y, hidden, batch, seconds)
        rows.append({"model": name, "batch": batch, "runner": "hand-written DDP (2 processes)",
                     "samples_per_s": samples / secs})
        print(rows[-1], flush=True)
    client = dt.connect(n_workers=2, quiet=True)
    try:
        for name, hidden, batch, _ in CASES:
            X, y = client.persist(list(data[name]))
            # The same data in 4 blocks instead of 16: the controller hands out and accounts for
            # blocks one task and one event each, and this row shows what that costs.
            X4, y4 = client.persist([X.rechunk(math.ceil(len(X) / 4)),
                                     y.rechunk(math.ceil(len(y) / 4))])
            ddp = next(r["samples_per_s"] for r in rows if r["model"] == name)
            variants = (("", X, y, {}), (", grad_accumulation=4", X, y, {"grad_accumulation": 4}),
                        (f", blocks of {math.ceil(len(X) / 4):,} rows", X4, y4, {}))
            for label, X_, y_, kwargs in variants:
                samples, secs, result = trainer_sync(client, X_, y_, hidden, batch, seconds,
                                                     score_every, **kwargs)
                rate = samples / secs
                rows.append({"model": name, "batch": batch,
                             "runner": f"Trainer sync, steady state{label}",
                             "samples_per_s": rate, "vs_ddp": rate / ddp,
                             "allreduce_share": [round(t["allreduce_s"] / t["busy_s"], 2)
                                                 for t in result.trainers]})
                print(rows[-1], flush=True)
    finally:
        client.close()
    for row in rows:
        row["samples/s"] = f"{row['samples_per_s']:,.0f}"
        row["vs DDP"] = f"{row['vs_ddp']:.2f}x" if "vs_ddp" in row else ""
        row["time waiting for all-reduce"] = ", ".join(f"{s:.0%}" for s in row.get("allreduce_share", []))
    table = markdown_table(rows, ["model", "batch", "runner", "samples/s", "vs DDP",
                                  "time waiting for all-reduce"])
    env = environment()
    machine = (f"Machine: {env['cores']} cores ({env['cpu']}), torch {env['torch']}, "
               f"distributed {env['distributed']}, Python {env['python']}; {env['date']}.")
    markdown = (f"# Synchronous training throughput\n\n{machine}\n\n{table}\n\n"
                f"Scorer every {score_every:g} s. Aim: Trainer sync >= 1.0x the hand-written "
                "DDP.\n")
    print(markdown)
    write_results("sync-quick" if args.quick else "sync", markdown, {"rows": rows, "env": env})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
