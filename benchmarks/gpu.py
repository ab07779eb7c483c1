"""One GPU: the Trainer (sync and async-ps, ``device="cuda"``) against a plain torch loop on the same GPU.

Usage::

    python benchmarks/gpu.py [--seconds S] [--batch-size B] [--hidden 4096,4096,4096] [--quick]

Model: MLP ``64-hidden-10`` (default 34.0 M parameters), Adam lr 1e-3, cross entropy, on generated
digits data (``dt.datasets.digits``; nothing is downloaded), batch ``--batch-size``.

* **plain torch**: this process, the model and data on ``cuda:0``; steps per second over about
  ``--seconds`` after warm-up steps, synchronised with the device at both ends;
* **Trainer** on ``dt.connect(n_workers=1)`` (one worker per GPU, as dask-cuda starts them), with
  ``device="cuda"``, stopped after ``--seconds`` of training: steps per second between the first and
  the last score taken while training ran (start-up excluded), and the start-up until the first score.

Without CUDA the script says so and exits 2. Results go to ``benchmarks/results/gpu.md`` and ``.json``
(``gpu-quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import dask
import torch
from _common import build_mlp, environment, markdown_table, write_results

import dask_train as dt


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=None,
                        help="training time of each runner (default 40, 12 with --quick)")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--hidden", default="4096,4096,4096", help="hidden widths, comma-separated")
    parser.add_argument("--score-every", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="a ~1 minute smoke test")
    args = parser.parse_args(argv)
    args.seconds = args.seconds or (12.0 if args.quick else 40.0)
    args.hidden = tuple(int(h) for h in args.hidden.split(","))
    return args


def plain_torch(X: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Steps per second of a plain loop on ``cuda:0``."""
    dev = torch.device("cuda:0")
    net = build_mlp(args.hidden).to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    X, y = X.to(dev), y.to(dev)
    gen = torch.Generator(device=dev).manual_seed(0)

    def step() -> None:
        idx = torch.randint(len(X), (args.batch_size,), generator=gen, device=dev)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(X[idx]), y[idx]).backward()
        opt.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        step()
        steps += 1
        if steps % 50 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {"runner": "plain torch, cuda:0", "steps": steps, "seconds": seconds,
            "steps_per_s": steps / seconds, "startup_s": math.nan, "scores": ""}


def trainer(X: Any, y: Any, strategy: str, args: argparse.Namespace) -> dict[str, Any]:
    """Steady-state steps per second of the Trainer on one GPU worker."""
    client = dt.connect(n_workers=1, quiet=True)
    try:
        X, y = client.persist([X, y])
        extra: dict[str, Any] = {"ps": 1} if strategy == "async-ps" else {}
        started = time.perf_counter()
        result = dt.Trainer(
            build_mlp(args.hidden), loss="cross_entropy", optimizer="adam", lr=1e-3,
            strategy=strategy, workers=1, batch_size=args.batch_size, device="cuda",
            epochs=10_000, stop=[dt.StopAfter(args.seconds)], score_every=args.score_every,
            progress=False, client=client, **extra,
        ).fit(X, y, validation=dt.datasets.digits_test())
        wall = time.perf_counter() - started
    finally:
        client.close()
    history = result.history
    during = history.iloc[:-1] if len(history) else history  # the last: taken after the stop
    steps, seconds = (
        (int(during["step"].iloc[-1] - during["step"].iloc[0]),
         float(during["time_s"].iloc[-1] - during["time_s"].iloc[0]))
        if len(during) >= 2 else (0, math.nan)
    )
    first_score = float(history["time_s"].iloc[0]) if len(history) else math.nan
    return {
        "runner": f"Trainer {strategy}, workers=1, device='cuda'", "steps": steps, "seconds": seconds,
        "steps_per_s": steps / seconds if seconds > 0 else math.nan, "startup_s": first_score,
        "scores": len(history), "wall_s": wall, "stopped_by": result.stopped_by,
        "final_accuracy": float(history["accuracy"].iloc[-1]) if len(history) else math.nan,
    }


def render(env: dict[str, Any], args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    base = rows[0]["steps_per_s"]
    cells = [{
        "runner": row["runner"], "steps/s": f"{row['steps_per_s']:.1f}",
        "samples/s": f"{row['steps_per_s'] * args.batch_size:,.0f}",
        "vs plain torch": f"{row['steps_per_s'] / base:.2f}x" if base > 0 else "nan",
        "steps timed": str(row["steps"]), "seconds": f"{row['seconds']:.1f}",
        "first score at (s)": "" if math.isnan(row["startup_s"]) else f"{row['startup_s']:.1f}",
        "final accuracy": "" if "final_accuracy" not in row else f"{row['final_accuracy']:.3f}",
    } for row in rows]
    params = sum(p.numel() for p in build_mlp(args.hidden).parameters()) / 1e6
    return "\n".join([
        f"# One GPU: MLP 64-{'-'.join(map(str, args.hidden))}-10 ({params:.1f} M parameters)"
        f"{' (quick smoke test)' if args.quick else ''}", "",
        f"Device: {torch.cuda.get_device_name(0)}; torch {env['torch']}, dask {env['dask']}, "
        f"Python {env['python']}; {env['date']}. Batch {args.batch_size}, Adam lr 1e-3. Trainer "
        "steps/s: between the first and last score taken during training (start-up excluded).",
        "", markdown_table(cells, list(cells[0])),
    ])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device here (torch.cuda.is_available() is False): run this on a GPU machine",
              file=sys.stderr)
        return 2
    env = environment()
    X, y = dt.datasets.digits(100_000, seed=0, chunks=12_500)
    X_np, y_np = dask.compute(X, y)
    rows = [plain_torch(torch.from_numpy(X_np), torch.from_numpy(y_np), args)]
    print(f"plain torch: {rows[0]['steps_per_s']:.1f} steps/s", file=sys.stderr, flush=True)
    torch.cuda.empty_cache()
    for strategy in ("sync", "async-ps"):
        rows.append(trainer(X, y, strategy, args))
        print(f"{rows[-1]['runner']}: {rows[-1]['steps_per_s']:.1f} steps/s", file=sys.stderr, flush=True)
    markdown = render(env, args, rows)
    print(markdown)
    paths = write_results("gpu-quick" if args.quick else "gpu", markdown,
                          {"environment": env, "settings": vars(args), "rows": rows})
    print("wrote " + ", ".join(os.path.relpath(p) for p in paths), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
