"""One GPU: the Trainer (sync and async-ps, ``device="cuda"``) against a plain torch loop on the same GPU.

Usage::

    python benchmarks/gpu.py [--seconds S] [--batch-size B] [--hidden 4096,4096,4096]
                             [--models mlp,cnn] [--strategies sync,async-ps] [--quick]

Models (``--models``): ``mlp``, an MLP ``64-hidden-10`` (default 34.0 M parameters), and ``cnn``, a
convolutional net with BatchNorm on the digits as 1x8x8 images (conv 128-BN-conv 256-conv 256-fc,
1.1 M parameters, about 57 M multiply-adds a sample); Adam lr 1e-3, cross entropy, on generated
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
    parser.add_argument("--models", default="mlp,cnn", help="models, comma-separated: mlp, cnn")
    parser.add_argument("--strategies", default="sync,async-ps",
                        help="the Trainer's strategies, comma-separated")
    parser.add_argument("--quick", action="store_true", help="a ~1 minute smoke test")
    args = parser.parse_args(argv)
    args.seconds = args.seconds or (12.0 if args.quick else 40.0)
    args.hidden = tuple(int(h) for h in args.hidden.split(","))
    args.models = [m for m in args.models.split(",") if m]
    args.strategies = [m for m in args.strategies.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"--models {','.join(unknown)}: choose from {', '.join(MODELS)}")
    return args


def cnn() -> torch.nn.Module:
    """A convolutional net on 1x8x8 images with BatchNorm (buffers kept in step every step)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 128, 3, padding=1), torch.nn.BatchNorm2d(128), torch.nn.ReLU(),
        torch.nn.Conv2d(128, 256, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(256, 256, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(256 * 64, 10))


#: model name -> (builder from the arguments, input shape of one sample)
MODELS: dict[str, tuple[Any, tuple[int, ...]]] = {
    "mlp": (lambda args: build_mlp(args.hidden), (64,)),
    "cnn": (lambda args: cnn(), (1, 8, 8)),
}


def describe(name: str, args: argparse.Namespace) -> str:
    net = MODELS[name][0](args)
    params = sum(p.numel() for p in net.parameters()) / 1e6
    if name == "mlp":
        return f"MLP 64-{'-'.join(map(str, args.hidden))}-10 ({params:.1f} M parameters)"
    return f"CNN conv128-BN-conv256-conv256-fc on 1x8x8 ({params:.1f} M parameters)"


def plain_torch(name: str, X: torch.Tensor, y: torch.Tensor, args: argparse.Namespace
                ) -> dict[str, Any]:
    """Steps per second of a plain loop on ``cuda:0``."""
    dev = torch.device("cuda:0")
    net = MODELS[name][0](args).to(dev)
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
    return {"model": name, "runner": "plain torch, cuda:0", "steps": steps, "seconds": seconds,
            "steps_per_s": steps / seconds, "startup_s": math.nan, "scores": ""}


def trainer(name: str, X: Any, y: Any, validation: Any, strategy: str, args: argparse.Namespace
            ) -> dict[str, Any]:
    """Steady-state steps per second of the Trainer on one GPU worker."""
    client = dt.connect(n_workers=1, quiet=True)
    try:
        X, y = client.persist([X, y])
        extra: dict[str, Any] = {"ps": 1} if strategy == "async-ps" else {}
        started = time.perf_counter()
        result = dt.Trainer(
            MODELS[name][0](args), loss="cross_entropy", optimizer="adam", lr=1e-3,
            strategy=strategy, workers=1, batch_size=args.batch_size, device="cuda",
            epochs=10_000, stop=[dt.StopAfter(args.seconds)], score_every=args.score_every,
            progress=False, client=client, **extra,
        ).fit(X, y, validation=validation)
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
        "model": name, "runner": f"Trainer {strategy}, workers=1, device='cuda'", "steps": steps,
        "seconds": seconds,
        "steps_per_s": steps / seconds if seconds > 0 else math.nan, "startup_s": first_score,
        "scores": len(history), "wall_s": wall, "stopped_by": result.stopped_by,
        "final_accuracy": float(history["accuracy"].iloc[-1]) if len(history) else math.nan,
    }


def render(env: dict[str, Any], args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    parts = [f"# One GPU{' (quick smoke test)' if args.quick else ''}", "",
             f"Device: {torch.cuda.get_device_name(0)}; torch {env['torch']}, dask {env['dask']}, "
             f"Python {env['python']}; {env['date']}. Batch {args.batch_size}, Adam lr 1e-3. "
             "Trainer steps/s: between the first and last score taken during training "
             "(start-up excluded); plain torch: its own loop on the same GPU, data on the GPU."]
    for name in args.models:
        mine = [row for row in rows if row["model"] == name]
        base = mine[0]["steps_per_s"]
        cells = [{
            "runner": row["runner"], "steps/s": f"{row['steps_per_s']:.1f}",
            "samples/s": f"{row['steps_per_s'] * args.batch_size:,.0f}",
            "vs plain torch": f"{row['steps_per_s'] / base:.2f}x" if base > 0 else "nan",
            "steps timed": str(row["steps"]), "seconds": f"{row['seconds']:.1f}",
            "first score at (s)": "" if math.isnan(row["startup_s"]) else
            f"{row['startup_s']:.1f}",
            "final accuracy": "" if "final_accuracy" not in row else
            f"{row['final_accuracy']:.3f}",
        } for row in mine]
        parts += ["", f"## {describe(name, args)}", "", markdown_table(cells, list(cells[0]))]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device here (torch.cuda.is_available() is False): run this on a GPU machine",
              file=sys.stderr)
        return 2
    env = environment()
    X, y = dt.datasets.digits(100_000, seed=0, chunks=12_500)
    X_np, y_np = dask.compute(X, y)
    Xv, yv = dt.datasets.digits_test()
    rows = []
    for name in args.models:
        shape = MODELS[name][1]
        rows.append(plain_torch(name, torch.from_numpy(X_np).reshape(-1, *shape),
                                torch.from_numpy(y_np), args))
        print(f"{name}, plain torch: {rows[-1]['steps_per_s']:.1f} steps/s", file=sys.stderr,
              flush=True)
        torch.cuda.empty_cache()
        for strategy in args.strategies:
            rows.append(trainer(name, X.reshape(-1, *shape), y, (Xv.reshape(-1, *shape), yv),
                                strategy, args))
            print(f"{name}, {rows[-1]['runner']}: {rows[-1]['steps_per_s']:.1f} steps/s",
                  file=sys.stderr, flush=True)
    markdown = render(env, args, rows)
    print(markdown)
    paths = write_results("gpu-quick" if args.quick else "gpu", markdown,
                          {"environment": env, "settings": vars(args), "rows": rows})
    print("wrote " + ", ".join(os.path.relpath(p) for p in paths), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
