"""Streaming training data from storage every epoch against the same job persisted.

Usage::

    python benchmarks/streaming.py [--n-samples N] [--block-rows R] [--epochs E] [--quick]
                                   [--large-limit-mib M] [--large-ratio K] [--only-large]

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

**Larger than memory** (the last two rows): the same job on a plain Dask ``LocalCluster`` of two
workers limited to ``--large-limit-mib`` (768 MiB) each, on npy files holding ``--large-ratio``
(3) times the room the workers have below Dask's spill threshold once torch and the roles are
imported (measured before the data is written). Streamed, then persisted: Dask spills the
persisted blocks to the workers' disks and reads them back every epoch (today's path for data
larger than memory), each mode on fresh workers. The table says how much was spilled and how
often a worker paused (and for how long, from the workers' logs); a worker paused for a minute
without a break has stayed paused (its memory that is not data is over the pause threshold, so
spilling cannot help: persisting then waits for it without end), and the row says so. Tried at
576 MiB: a worker that had imported the benchmark's libraries held about 345 MiB before any
data, and persisting left one paused for good. A plain ``LocalCluster``, not ``dt.connect``: the
embedded cluster keeps freed memory in its workers (glibc thresholds raised for training speed),
so a worker that spills never gets back under its pause threshold (tried once at 512 MiB: both
workers paused at 81-84% and were still paused two minutes later).
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
from _common import build_mlp, cpu_load, environment, markdown_table, write_results

import dask_train as dt
from dask_train.data._cluster import live_workers

S3_BUCKET = "bench"


def _spilled(dask_worker: Any) -> int:
    return int(sum(v for k, v in dask_worker.digests_total.items()
                   if "disk-write" in str(k) and "bytes" in str(k)))


_PAUSE = re.compile(r"^(\S+ \S+) - distributed\.worker\.memory - WARNING - .*(Pausing|Resuming) worker")


def _pauses(client: Any) -> list[tuple[str, float, str]]:
    """Every pause and resume in the workers' logs: (worker, time, "Pausing" | "Resuming")."""
    events = []
    for worker, lines in client.get_worker_logs().items():
        for _, message in lines:
            m = _PAUSE.match(message)
            if m:
                at = time.mktime(time.strptime(m[1].split(",")[0], "%Y-%m-%d %H:%M:%S"))
                events.append((worker, at + int(m[1].split(",")[1]) / 1000, m[2]))
    return sorted(events, key=lambda e: e[1])


def _paused_s(events: list[tuple[str, float, str]], until: float) -> float:
    """Seconds any worker spent paused, summed over workers (a pause still on ends ``until``)."""
    total, since = 0.0, {}
    for worker, at, what in events:
        if what == "Pausing":
            since.setdefault(worker, at)
        elif worker in since:
            total += at - since.pop(worker)
    return total + sum(until - at for at in since.values())


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
    spilled, pauses = sum(client.run(_spilled).values()), len(_pauses(client))
    with cpu_load() as load:
        started = time.perf_counter()
        result = trainer.fit(X, y, data=mode)
        seconds = time.perf_counter() - started
    events = _pauses(client)[pauses:]
    t = result.timings
    return {"mode": mode, "samples": result.samples, "train_s": t["train"], "fit_s": seconds,
            "persist_s": t["persist"], "read_s": sum(r["read_s"] for r in result.trainers),
            "samples_per_s": result.samples / t["train"],
            "feed_wait_s": sum(r.get("feed_wait_s", 0.0) for r in result.trainers),
            "held_bytes_max": max(r.get("held_bytes_max", 0) for r in result.trainers),
            "spilled": sum(client.run(_spilled).values()) - spilled,
            "pauses": sum(e[2] == "Pausing" for e in events),
            "paused_s": _paused_s(events, time.time()),
            "memory_limit": max(r.get("memory_limit", 0) for r in result.trainers),
            "other_load": load.foreign}


def _import_roles() -> None:
    import dask_train.engines.ps.engine  # noqa: F401  (torch and the roles' code)


def _room(dask_worker: Any) -> float:
    """Bytes this worker may still grow before Dask's spill threshold."""
    manager = dask_worker.memory_manager
    used = dask_worker.monitor.get_process_memory()
    return float(manager.memory_spill_fraction * manager.memory_limit - used)


def write_npy(root: Path, n: int, rows: int) -> tuple[Any, Any]:
    """The inflated digits, ``n`` rows, as one .npy file per block of ``rows`` (computed a block
    at a time: the data may not fit here either); how to open them."""
    X, y = dt.datasets.digits(n_samples=n, chunks=rows, seed=0)
    paths = []
    for i, start in enumerate(range(0, n, rows)):
        paths.append(str(root / f"x-{i:04d}.npy"))
        np.save(paths[-1], X[start : start + rows].compute(scheduler="threads"))
    np.save(root / "y.npy", y.compute(scheduler="threads"))
    return dt.from_npy(paths), dt.from_npy(str(root / "y.npy"), block_rows=rows)


#: A persisting worker paused this long without a break has stayed paused: its memory that is
#: not data (unmanaged) is over the pause threshold, and spilling cannot bring it back.
STUCK_S = 60.0


@contextmanager
def limited_cluster(limit: int) -> Iterator[Any]:
    """A plain Dask LocalCluster of two one-thread workers limited to ``limit`` bytes each, torch
    and the roles' code imported; its client."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      memory_limit=limit) as cluster, Client(cluster) as client:
        client.run(_import_roles)
        yield client


def watched_fit(client: Any, X: Any, y: Any, mode: str, epochs: int) -> dict[str, Any]:
    """:func:`fit`, ended with the cluster when a worker stays paused for ``STUCK_S`` (persisting
    waits for a paused worker's blocks without end); the row then says so."""
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(fit, client, X, y, mode, epochs)
        paused_since: dict[str, float] = {}
        while not job.done():
            time.sleep(1.0)
            for address, w in live_workers(client).items():
                if w["status"] != "paused":
                    paused_since.pop(address, None)
                else:
                    paused_since.setdefault(address, time.time())
            if paused_since and time.time() - min(paused_since.values()) > STUCK_S:
                events = _pauses(client)
                client.cluster.close()
                return {"mode": mode, "stuck": f"stayed paused (over {STUCK_S:.0f} s, stopped)",
                        "pauses": sum(e[2] == "Pausing" for e in events),
                        "paused_s": _paused_s(events, time.time())}
        return job.result()


def larger_than_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Streamed, then persisted (and spilled), each on fresh workers whose room below Dask's
    spill threshold is ``1 / args.large_ratio`` of the data."""
    limit = args.large_limit_mib * 2**20
    with limited_cluster(limit) as client:
        room = sum(client.run(_room).values())
    row_bytes = 64 * 4 + 8  # float32 features, int64 label
    blocks = math.ceil(args.large_ratio * room / row_bytes / args.block_rows)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        X, y = write_npy(Path(tmp), blocks * args.block_rows, args.block_rows)
        note = {"store": f"npy, {blocks * args.block_rows / 1e6:.1f}M rows",
                "data_over_room": blocks * args.block_rows * row_bytes / room,
                "memory_limit": limit}
        for mode in ("stream", "persist"):
            with limited_cluster(limit) as client:
                rows.append({**note, **watched_fit(client, X, y, mode, args.epochs)})
            print(_line(rows[-1]), flush=True)
    return rows


def three_stores(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The job persisted and streamed from npy files, a zarr store on disk and one on S3, on
    ``dt.connect`` workers (no memory limit below the machine's)."""
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
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=1_100_000)
    parser.add_argument("--block-rows", type=int, default=50_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--large-limit-mib", type=int, default=768,
                        help="memory limit of each worker for the larger-than-memory rows")
    parser.add_argument("--large-ratio", type=float, default=3.0,
                        help="data over the workers' room below the spill threshold")
    parser.add_argument("--only-large", action="store_true",
                        help="only the larger-than-memory rows")
    parser.add_argument("--quick", action="store_true", help="200,000 rows, one epoch")
    args = parser.parse_args(argv)
    if args.quick:
        args.n_samples, args.block_rows, args.epochs = 200_000, 20_000, 1
        args.large_ratio = 1.5
    rows = [] if args.only_large else three_stores(args)
    rows += larger_than_memory(args)
    table = markdown_table([_cells(r, rows) for r in rows], COLUMNS)
    env_notes = environment()
    print()
    print(table)
    name = "streaming" + ("-quick" if args.quick else "") + ("-large" if args.only_large else "")
    markdown = (f"# Streaming against persisting ({'quick' if args.quick else 'full'})\n\n"
                f"{table}\n\nEnvironment: {env_notes}\n")
    write_results(name, markdown, {"rows": rows, "env": env_notes, "args": vars(args)})
    return 0


COLUMNS = ["store", "data", "samples/s", "vs persisted", "fit s", "read/persist s",
           "trainers waiting for data s", "held per trainer", "worker memory limit", "spilled",
           "worker pauses", "other load (cores)"]


def _line(row: dict[str, Any]) -> str:
    if "stuck" in row:
        return f"{row['store']:<11} {row['mode']:<8} {row['stuck']}"
    return (f"{row['store']:<11} {row['mode']:<8} "
            f"{row['samples_per_s']:>10,.0f} samples/s  fit {row['fit_s']:.1f} s")


def _cells(row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, str]:
    base = next(r for r in rows if r["store"] == row["store"] and r["mode"] == "persist")
    limit = row["memory_limit"]  # the job's workers'
    large = "data_over_room" in row
    data = row["mode"] + (" (spills)" if large and row["mode"] == "persist" else "")
    store = row["store"] + (f" ({row['data_over_room']:.1f}x the room)" if large else "")
    if "stuck" in row:
        return {"store": store, "data": data, "samples/s": row["stuck"],
                "worker pauses": f"{row['pauses']} ({row['paused_s']:.0f} s)"}
    ratio = "" if row is base or "stuck" in base else \
        f"{row['samples_per_s'] / base['samples_per_s']:.2f}x"
    return {"store": store, "data": data, "samples/s": f"{row['samples_per_s']:,.0f}",
            "vs persisted": ratio,
            "fit s": f"{row['fit_s']:.1f}",
            "read/persist s": f"{row['read_s'] if row['mode'] == 'stream' else row['persist_s']:.1f}",
            "trainers waiting for data s": f"{row['feed_wait_s']:.1f}",
            "held per trainer": f"{row['held_bytes_max'] / 2**20:.0f} MiB",
            "worker memory limit": f"{limit / 2**30:.1f} GiB" if limit >= 2**30 else
                                   f"{limit / 2**20:,.0f} MiB",
            "spilled": f"{row['spilled'] / 2**20:,.0f} MiB",
            "worker pauses": f"{row['pauses']} ({row['paused_s']:.1f} s)",
            "other load (cores)": f"{row['other_load']:.2f}"}


if __name__ == "__main__":
    sys.exit(main())
