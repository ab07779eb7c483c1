"""Throughput on the models PyTorch users bring: a BatchNorm MLP, a small CNN, an LSTM, a tied-weight
net and a small transformer encoder on the digits.

Usage::

    python benchmarks/models.py [--seconds 15] [--quick]

For each model (digits as 64 features for the BatchNorm MLP 64-256-BN-256-BN-10, as 1x8x8 images
for the CNN conv16-BN-pool-conv32-fc10; the LSTM reads the 8x8 digit as 8 steps of 8 values, the
transformer encoder as 8 tokens of 8 values; the tied net uses one 64x64 weight in two layers),
batch 128, Adam lr 1e-3:

* plain torch, one process with 2 threads, shuffled in-memory batches (the reference);
* ``dt.Trainer`` with ``strategy="async-ps"`` (1 server, 2 trainers) and ``strategy="sync"``
  (2 ranks, gloo) on ``dt.connect(n_workers=2)``, scorer every 2 s; steady state is the rate
  between the first and the last score taken during training (start-up left out).

Samples per second and the ratio to plain torch with 2 threads, in one run, printed and written
to ``results/models.md``; nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import build_mlp, cpu_load, environment, markdown_table, wait_for_quiet, write_results  # noqa: E402

import dask_train as dt  # noqa: E402


def bn_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
        torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10))


def cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(32 * 16, 10))


class LSTMNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(8, 48, batch_first=True)
        self.head = torch.nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x.reshape(-1, 8, 8))
        return self.head(out[:, -1])


class TiedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.b.weight = self.a.weight
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 32)
        self.position = torch.nn.Parameter(torch.zeros(8, 32))
        layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(x.reshape(-1, 8, 8)) + self.position)
        return self.head(h.mean(dim=1))


def seeded(cls: type) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return cls()
    return make


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...]]] = {
    "BatchNorm MLP 64-256-256-10": (bn_mlp, (64,)),
    "CNN conv16-BN-conv32-fc (1x8x8)": (cnn, (1, 8, 8)),
    "LSTM 8x8 steps, 48 hidden": (seeded(LSTMNet), (64,)),
    "tied 64-64(tied)-64-10": (seeded(TiedNet), (64,)),
    "transformer encoder 2x(d=32, 4 heads)": (seeded(Encoder), (64,)),
}
BATCH = 128


def side_by_side() -> dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...]]]:
    """The three models that ``throughput.py --models-table`` and ``throughput_intervals.py``
    compare (issue 57): the large MLP, the CNN and the token transformer, each with the shape
    its digit takes."""
    return {
        "MLP 64-1024-1024-10": (functools.partial(build_mlp, (1024, 1024)), (64,)),
        "CNN conv16-BN-conv32-fc": (cnn, (1, 8, 8)),
        "transformer 2x(d=32, 4 heads)": (seeded(Encoder), (64,)),
    }


def plain_torch(make: Callable[[], torch.nn.Module], x: np.ndarray, y: np.ndarray,
                seconds: float) -> dict[str, Any]:
    torch.set_num_threads(2)
    net, X, Y = make(), torch.from_numpy(x), torch.from_numpy(y)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        idx = torch.randint(0, len(X), (BATCH,), generator=gen)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(X[idx]), Y[idx]).backward()
        opt.step()

    for _ in range(20):
        step()
    with cpu_load() as load:
        steps, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            step()
            steps += 1
    return {"runner": "torch, 2 threads", "samples_per_s": steps * BATCH / load.wall_s,
            "other_load": load.foreign}


def trainer(make: Callable[[], torch.nn.Module], X: Any, y: Any, validation: Any, client: Any,
            strategy: str, seconds: float) -> dict[str, Any]:
    result = dt.Trainer(make(), strategy=strategy, ps=1, workers=2, lr=1e-3, batch_size=BATCH,
                        epochs=1000, score_every=2.0, stop=[dt.StopAfter(seconds=seconds)],
                        progress=False, client=client).fit(X, y, validation=validation)
    history = result.history.iloc[:-1]  # the last row is the score after the stop
    history = history[history["samples"] < result.samples]
    if len(history) < 2:
        rate = math.nan
    else:
        first, last = history.iloc[0], history.iloc[-1]
        rate = (last["samples"] - first["samples"]) / (last["time_s"] - first["time_s"])
    return {"runner": f"Trainer {strategy}, steady state", "samples_per_s": rate,
            "accuracy": float(result.history["accuracy"].iloc[-1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="", help="comma-separated substrings of model names "
                        "to run (default: all)")
    args = parser.parse_args(argv)
    chosen = {k: v for k, v in MODELS.items()
              if not args.models or any(m.strip() in k for m in args.models.split(","))}
    seconds = 4.0 if args.quick else args.seconds
    n = 100_000 if args.quick else 400_000
    client = dt.connect(n_workers=2, quiet=True)
    rows = []
    try:
        X, y = client.persist(dt.datasets.digits(n, seed=0, chunks=25_000))
        x_np, y_np = client.compute([X, y], sync=True)
        xv, yv = dt.datasets.digits_test()
        for name, (make, shape) in chosen.items():
            Xm, xm, xvm = X.reshape(-1, *shape), x_np.reshape(-1, *shape), xv.reshape(-1, *shape)
            wait_for_quiet(max_wait_s=30)
            reference = plain_torch(make, xm, y_np, seconds)
            rows.append({"model": name, **reference})
            for strategy in ("async-ps", "sync"):
                wait_for_quiet(max_wait_s=30)
                row = trainer(make, Xm, y, (xvm, yv), client, strategy, seconds)
                row["vs torch 2 threads"] = f"{row['samples_per_s'] / reference['samples_per_s']:.2f}x"
                rows.append({"model": name, **row})
                print(rows[-1], flush=True)
    finally:
        client.close()
    shown = [{**r, "samples_per_s": f"{r['samples_per_s']:,.0f}"} for r in rows]
    table = markdown_table(shown, ["model", "runner", "samples_per_s", "vs torch 2 threads"])
    print(table)
    write_results("models" + ("-quick" if args.quick else ""), table,
                  {"environment": environment(), "rows": rows, "seconds": seconds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
