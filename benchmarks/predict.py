"""Prediction over a large dask array: ``dt.predict`` against ``X.map_blocks`` with the model in every task.

Usage::

    python benchmarks/predict.py [--n-samples N] [--chunks ROWS] [--repeats R] [--quick]

The digits data (``dt.datasets.digits``, 1.1M rows by default, 22 blocks of 50,000) is persisted on
``dt.connect(n_workers=2)`` first, so only prediction is timed. Two models: the digits MLP
64-100-10 (7,510 parameters) and MLP 64-1024-1024-10 (1.1M parameters, 4.5 MB), random weights.
Each runner computes the model's outputs (class scores) for every row and keeps them on the
cluster (``persist`` and wait), so no result travels to the client:

* **dt.predict**: ``dt.predict(net, X)``: the model is pickled once into one graph key; each block's
  task depends on it and unpickles it at most once per worker; forward passes of 4,096 rows.
* **map_blocks**: ``X.map_blocks(forward, net)``: what one writes without dask-train; the model is
  an argument of every task, so it travels and is unpickled with each one; one forward pass per
  block under ``torch.no_grad``.

"Bytes sent" counts what the work itself made Dask move: the pickled task specifications of the
prediction's own graph (what the scheduler ships to the workers, the model included wherever a task
holds it) plus the bytes workers sent each other meanwhile (``transfer_outgoing_bytes_total``: the
model fetched by the second worker, and any block a task had to fetch). Rows/s is the mean over
``--repeats`` runs, after a warm-up of each runner on a small array.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import cloudpickle
import dask.array as da
import numpy as np
import torch
from _common import build_mlp, cpu_load, environment, markdown_table, write_results
from distributed import Client, wait

import dask_train as dt

CASES = (("MLP 64-100-10", (100,)), ("MLP 64-1024-1024-10", (1024, 1024)))


def forward(block: np.ndarray, model: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(block)).numpy()


def map_blocks(net: torch.nn.Module, X: da.Array) -> da.Array:
    return X.map_blocks(forward, net, dtype=np.float32, chunks=(X.chunks[0], (10,)))


def dt_predict(net: torch.nn.Module, X: da.Array) -> da.Array:
    return dt.predict(net, X)


def spec_bytes(result: da.Array, X: da.Array) -> int:
    """Pickled size of every task of ``result``'s graph that is not one of X's blocks."""
    graph = dict(result.__dask_graph__())
    own = set(graph) - set(dict(X.__dask_graph__()))
    return sum(len(cloudpickle.dumps(graph[key], protocol=pickle.HIGHEST_PROTOCOL)) for key in own)


def sent_between_workers(client: Client) -> int:
    return sum(client.run(lambda dask_worker: dask_worker.transfer_outgoing_bytes_total).values())


def measure(client: Client, run: Any, net: torch.nn.Module, X: da.Array) -> dict[str, float]:
    before = sent_between_workers(client)
    with cpu_load() as load:
        started = time.perf_counter()
        result = run(net, X).persist()
        wait(result, timeout=600)
        seconds = time.perf_counter() - started
    moved = sent_between_workers(client) - before
    graph = spec_bytes(run(net, X), X)
    del result
    return {"seconds": seconds, "rows_per_s": X.shape[0] / seconds, "spec_bytes": graph,
            "worker_bytes": moved, "other_load": load.foreign}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=1_100_000)
    parser.add_argument("--chunks", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="100,000 rows, one repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.n_samples, args.chunks, args.repeats = 100_000, 10_000, 1
    client = dt.connect(n_workers=2, quiet=True)
    rows = []
    try:
        X, _ = dt.datasets.digits(n_samples=args.n_samples, chunks=args.chunks, seed=0)
        X = X.persist()
        wait(X)
        small = X[: args.chunks * 2]
        for model, hidden in CASES:
            net = build_mlp(hidden)
            size = len(cloudpickle.dumps(net))
            for name, run in (("dt.predict", dt_predict), ("map_blocks", map_blocks)):
                run(net, small).compute()  # warm-up: torch in the workers, the model cached
                runs = [measure(client, run, net, X) for _ in range(args.repeats)]
                rows.append({"model": model, "model_bytes": size, "runner": name,
                             "rows": X.shape[0], "blocks": X.numblocks[0], "runs": runs,
                             "rows_per_s": statistics.mean(r["rows_per_s"] for r in runs),
                             "spec_bytes": runs[0]["spec_bytes"],
                             "worker_bytes": statistics.mean(r["worker_bytes"] for r in runs),
                             "other_load": max(r["other_load"] for r in runs)})
                print(f"{model:<22} {name:<11} {rows[-1]['rows_per_s']:>12,.0f} rows/s", flush=True)
    finally:
        client.close()
    table = markdown_table([_cells(r, rows) for r in rows],
                           ["model", "runner", "rows/s", "vs map_blocks", "task specs",
                            "between workers", "rows", "blocks", "other load (cores)"])
    env = environment()
    print()
    print(table)
    markdown = (f"# dt.predict vs map_blocks ({'quick' if args.quick else 'full'})\n\n{table}\n\n"
                f"Environment: {env}\n")
    write_results("predict-quick" if args.quick else "predict", markdown, {"rows": rows, "env": env})
    return 0


def _cells(row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, str]:
    base = next(r for r in rows if r["model"] == row["model"] and r["runner"] == "map_blocks")
    ratio = row["rows_per_s"] / base["rows_per_s"]
    return {"model": f"{row['model']} ({row['model_bytes'] / 1e6:.2f} MB)", "runner": row["runner"],
            "rows/s": f"{row['rows_per_s']:,.0f}",
            "vs map_blocks": "" if row is base else f"{ratio:.2f}x",
            "task specs": f"{row['spec_bytes'] / 1e6:.2f} MB",
            "between workers": f"{row['worker_bytes'] / 1e6:.2f} MB",
            "rows": f"{row['rows']:,}", "blocks": str(row["blocks"]),
            "other load (cores)": f"{row['other_load']:.2f}"}


if __name__ == "__main__":
    sys.exit(main())
