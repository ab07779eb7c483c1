"""Streaming training data from storage every epoch against the same job persisted.

Usage::

    python benchmarks/streaming.py [--n-samples N] [--block-rows R] [--epochs E] [--quick]

The job: the digits inflated to 1.1M rows (``dt.datasets.digits``, seed 0; 282 MB of float32
features), an MLP 64-100-10, async-ps with 2 trainers and 1 parameter server, Adam, batches of 128,
two epochs, no scorer (only the trainers' rate is measured), on ``dt.connect(n_workers=2)``. The
data is written once, before any timing, to three stores, in blocks of ``--block-rows`` rows
(50,000: 12.8 MB):

* **npy**: one ``.npy`` file per block, read with ``dt.from_npy``;
* **zarr, disk**: an uncompressed zarr store on the local disk, ``da.from_zarr``;
* **zarr, S3**: the same store on a local S3 server (moto's server mode, one Python process, on
  this machine), read through s3fs by the workers.

Each store trains twice: ``data="persist"`` (the blocks are read once into the workers' memory
before training) and ``data="stream"`` (each block is read on its trainer's worker every epoch).
"samples/s" is the samples trained divided by the training phase (``result.timings["train"]``:
first update to the end of the data); "fit" is the whole ``fit`` call, reading and persisting
included. One run of each; the machine's other load is printed with each (cores used by
processes that are not the benchmark's). Nothing is asserted.

Not here: data larger than the workers' memory. Streamed, it trains with nothing spilled
(``tests/data/test_streaming.py``); persisting the 1.1M rows on ``dt.connect`` workers limited
to 512 MiB paused both workers at 81-84% of their limit, still paused two minutes later when the
run was stopped (one try; the embedded cluster's malloc settings keep freed memory in the
process, so spilling did not bring a worker back under the limit).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
from _common import build_mlp, cpu_load, environment, markdown_table, write_results

import dask_train as dt

S3_BUCKET = "bench"


def _spilled(dask_worker: Any) -> int:
    return int(sum(v for k, v in dask_worker.digests_total.items()
                   if "disk-write" in str(k) and "bytes" in str(k)))


def write_stores(root: Path, x: np.ndarray, y: np.ndarray, rows: int,
                 s3: dict[str, Any]) -> dict[str, Any]:
    """The three stores; returns how to open each (a function of nothing)."""
    import zarr

    paths = []
    for i, start in enumerate(range(0, len(x), rows)):
        paths.append(str(root / f"x-{i:03d}.npy"))
        np.save(paths[-1], x[start : start + rows])
    np.save(root / "y.npy", y)

    def to_zarr(url: str, a: np.ndarray, **storage: Any) -> None:
        z = zarr.create_array(url, shape=a.shape, chunks=(rows, *a.shape[1:]), dtype=a.dtype,
                              compressors=None, storage_options=storage or None)
        z[:] = a

    for base, storage in ((str(root), {}), (f"s3://{S3_BUCKET}", s3)):
        to_zarr(f"{base}/x.zarr", x, **storage)
        to_zarr(f"{base}/y.zarr", y, **storage)
    return {
        "npy": lambda: (dt.from_npy(paths), dt.from_npy(str(root / "y.npy"), block_rows=rows)),
        "zarr, disk": lambda: (da.from_zarr(str(root / "x.zarr")), da.from_zarr(str(root / "y.zarr"))),
        "zarr, S3": lambda: (da.from_zarr(f"s3://{S3_BUCKET}/x.zarr", storage_options=s3),
                             da.from_zarr(f"s3://{S3_BUCKET}/y.zarr", storage_options=s3)),
    }


def start_s3() -> tuple[Any, dict[str, Any], dict[str, str]]:
    """A local S3 server on a free port with the bucket; s3fs options and the workers' env."""
    import s3fs
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    endpoint = f"http://127.0.0.1:{port}"
    options = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": endpoint}}
    s3fs.S3FileSystem(**options).mkdir(S3_BUCKET)
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_ENDPOINT_URL": endpoint}
    return server, options, env


def fit(client: Any, X: Any, y: Any, mode: str, epochs: int) -> dict[str, Any]:
    trainer = dt.Trainer(build_mlp((100,)), lr=1e-3, ps=1, workers=2, scorer=0, batch_size=128,
                         epochs=epochs, progress=False, client=client, timeout=120)
    spilled = sum(client.run(_spilled).values())
    with cpu_load() as load:
        started = time.perf_counter()
        result = trainer.fit(X, y, data=mode)
        seconds = time.perf_counter() - started
    t = result.timings
    return {"mode": mode, "samples": result.samples, "train_s": t["train"], "fit_s": seconds,
            "persist_s": t["persist"], "read_s": sum(r["read_s"] for r in result.trainers),
            "samples_per_s": result.samples / t["train"],
            "feed_wait_s": sum(r.get("feed_wait_s", 0.0) for r in result.trainers),
            "held_bytes_max": max(r.get("held_bytes_max", 0) for r in result.trainers),
            "spilled": sum(client.run(_spilled).values()) - spilled,
            "other_load": load.foreign}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=1_100_000)
    parser.add_argument("--block-rows", type=int, default=50_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="200,000 rows, one epoch")
    args = parser.parse_args(argv)
    if args.quick:
        args.n_samples, args.block_rows, args.epochs = 200_000, 20_000, 1
    X, y = dt.datasets.digits(n_samples=args.n_samples, chunks=args.block_rows, seed=0)
    x_np, y_np = X.compute(scheduler="threads"), y.compute(scheduler="threads")
    server, options, env = start_s3()
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            stores = write_stores(Path(tmp), x_np, y_np, args.block_rows, options)
            del x_np, y_np
            with dt.connect(n_workers=2, quiet=True, dashboard=False, env=env) as client:
                fit(client, *stores["npy"](), "persist", 1)  # warm-up: imports in the workers
                for store, open_store in stores.items():
                    for mode in ("persist", "stream"):
                        rows.append({"store": store, **fit(
                            client, *open_store(), mode, args.epochs)})
                        print(_line(rows[-1]), flush=True)
    finally:
        server.stop()
    table = markdown_table([_cells(r, rows) for r in rows], COLUMNS)
    env_notes = environment()
    print()
    print(table)
    name = "streaming-quick" if args.quick else "streaming"
    markdown = (f"# Streaming against persisting ({'quick' if args.quick else 'full'})\n\n"
                f"{table}\n\nEnvironment: {env_notes}\n")
    write_results(name, markdown, {"rows": rows, "env": env_notes, "args": vars(args)})
    return 0


COLUMNS = ["store", "data", "samples/s", "vs persisted", "fit s", "read/persist s",
           "trainers waiting for data s", "held per trainer", "other load (cores)"]


def _line(row: dict[str, Any]) -> str:
    return (f"{row['store']:<11} {row['mode']:<8} "
            f"{row['samples_per_s']:>10,.0f} samples/s  fit {row['fit_s']:.1f} s")


def _cells(row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, str]:
    base = next(r for r in rows if r["store"] == row["store"] and r["mode"] == "persist")
    ratio = row["samples_per_s"] / base["samples_per_s"]
    return {"store": row["store"], "data": row["mode"], "samples/s": f"{row['samples_per_s']:,.0f}",
            "vs persisted": "" if row is base else f"{ratio:.2f}x",
            "fit s": f"{row['fit_s']:.1f}",
            "read/persist s": f"{row['read_s'] if row['mode'] == 'stream' else row['persist_s']:.1f}",
            "trainers waiting for data s": f"{row['feed_wait_s']:.1f}",
            "held per trainer": f"{row['held_bytes_max'] / 2**20:.0f} MiB",
            "other load (cores)": f"{row['other_load']:.2f}"}


if __name__ == "__main__":
    sys.exit(main())
