"""Numpy sync training: ``Trainer(dt.ArrayModel, strategy="sync")`` against one numpy process.

Usage::

    python benchmarks/sync_array.py [--n-samples N] [--steps S] [--quick]

Measured in one run, for a softmax regression (64 features, 10 classes, Adam) on the generated
digits, at several batch sizes per worker:

* **one process**: the same steps in this process with numpy on the in-memory data: each step
  takes a random global batch (2x the per-worker batch), computes the same ``loss_grad`` and
  applies the same torch optimizer. numpy's BLAS may use both cores here.
* **Trainer**: ``dt.Trainer(dt.softmax_regression(64, 10), strategy="sync")`` on
  ``dt.connect(n_workers=2)`` (one thread each), no scorer, ``StopAtStep(steps)``: each step is
  one task per worker on its own blocks, a tree reduction on the workers and one result to the
  client, so the per-step cost has a floor of a few task round trips (the batch-1 row shows it).

Ratios are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import dask
import numpy as np
import torch
from _common import environment, markdown_table, write_results

import dask_train as dt
from dask_train.models import build_optimizer
from dask_train.policy._settings import OptimizerSettings

BATCHES = (1, 1024, 16_384)


def one_process(x: np.ndarray, y: np.ndarray, batch: int, steps: int) -> tuple[int, float]:
    """Samples and seconds of ``steps`` numpy steps on global batches of ``batch`` rows."""
    model = dt.softmax_regression(64, 10)
    param = torch.nn.Parameter(torch.from_numpy(model.params.copy()))
    param.grad = torch.zeros_like(param)
    opt = build_optimizer(OptimizerSettings("adam", 0.01), [param])
    rng = np.random.default_rng(0)
    x = x.astype(np.float64)
    started = time.perf_counter()
    for _ in range(steps):
        idx = rng.integers(0, len(x), batch)
        _, grad = model.loss_grad(param.detach().numpy(), x[idx], y[idx])
        param.grad.copy_(torch.from_numpy(grad / batch))
        opt.step()
    return steps * batch, time.perf_counter() - started


def trainer(client: Any, X: Any, y: Any, batch: int, steps: int) -> tuple[int, float]:
    """Samples and seconds of the Trainer, from its first step to its last."""
    result = dt.Trainer(dt.softmax_regression(64, 10), strategy="sync", optimizer="adam", lr=0.01,
                        batch_size=batch, epochs=10_000, scorer=0, progress=False, client=client,
                        stop=[dt.StopAtStep(steps)]).fit(X, y)
    return result.samples, result.wall_s


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=400_000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    n = 40_000 if args.quick else args.n_samples
    steps = 20 if args.quick else args.steps
    X, y = dt.datasets.digits(n, seed=0, chunks=n // 16)
    x_local, y_local = dask.compute(X, y)
    rows: list[dict[str, Any]] = []
    for batch in BATCHES:
        samples, secs = one_process(x_local, y_local, 2 * batch, steps)
        rows.append({"batch per worker": batch, "runner": "one numpy process",
                     "samples_per_s": samples / secs, "ms_per_step": 1e3 * secs / steps})
        print(rows[-1], flush=True)
    client = dt.connect(n_workers=2, quiet=True)
    try:
        X, y = client.persist([X, y])
        trainer(client, X, y, 1, 5)  # warm-up: imports and the first tasks on the workers
        for batch in BATCHES:
            samples, secs = trainer(client, X, y, batch, steps)
            base = next(r["samples_per_s"] for r in rows if r["batch per worker"] == batch)
            rows.append({"batch per worker": batch, "runner": "Trainer sync, 2 workers",
                         "samples_per_s": samples / secs, "ms_per_step": 1e3 * secs / steps,
                         "vs_one": samples / secs / base})
            print(rows[-1], flush=True)
    finally:
        client.close()
    rows.sort(key=lambda r: (r["batch per worker"], "vs_one" in r))
    for row in rows:
        row["samples/s"] = f"{row['samples_per_s']:,.0f}"
        row["ms per step"] = f"{row['ms_per_step']:.1f}"
        row["vs one process"] = f"{row['vs_one']:.2f}x" if "vs_one" in row else ""
    table = markdown_table(rows, ["batch per worker", "runner", "samples/s", "ms per step",
                                  "vs one process"])
    env = environment()
    machine = (f"Machine: {env['cores']} cores ({env['cpu']}), torch {env['torch']}, "
               f"distributed {env['distributed']}, Python {env['python']}; {env['date']}.")
    markdown = (f"# Numpy sync training (ArrayModel)\n\n{machine}\n\n{n:,} rows, {steps} steps, "
                f"softmax regression 64x10, Adam.\n\n{table}\n")
    print(markdown)
    write_results("sync-array-quick" if args.quick else "sync-array", markdown,
                  {"rows": rows, "env": env})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
