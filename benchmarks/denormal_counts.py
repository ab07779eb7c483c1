"""Where denormal floats come from: subnormal values counted in the parameters, gradients and Adam
state of dask-train's update path and of a plain torch loop, with flush-to-zero off.

Usage::

    python benchmarks/denormal_counts.py [--steps 3000] [--every 250] [--seconds 40]

For the MLP 64-1024-1024-10 (Adam 1e-3, batch 128, digits; 1,059,850 parameters), with
``dask-train.flush-denormal: false`` (and ``torch.set_flush_denormal(False)`` here), counts the
float32 values with 0 < |x| < 2**-126 (torch.finfo(float32).tiny) every ``--every`` steps in:

* **in this process, one thread, same seed and same batches**: plain torch as users run it
  (``torch.optim.Adam`` with its CPU default, the per-tensor loop), plain torch with
  ``fused=True``, and dask-train's own update (:class:`~dask_train.engines.holders.optim.
  FlatOptimizer` over the flat parameter vector, the fused kernel a server shard or a sync rank
  steps; the module's gradients are gathered into its flat gradient buffer as a trainer does);
  also the elements whose gradient was exactly 0 at that step (dead ReLU units, pixels that are
  0 in every digit) and the float32 values a step would make denormal next (the moment's
  ``exp_avg`` between 2**-126 and 2**-126 / 0.9);
* **a real async-ps job** (``ps=1, workers=2`` on ``dt.connect(n_workers=2)``, ``--seconds``):
  every few seconds, on each worker, the server's shard (its parameters, gradient buffer,
  ``exp_avg``, ``exp_avg_sq``: in host memory, what both trainers step) and each trainer's
  gradient buffers and model parameters (its copy of the servers' values).

Counted by the float's bits (exponent 0, mantissa not 0), so a thread with DAZ on still sees
them. Nothing is timed but the steps' wall clock, printed for orientation only.
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dask
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import build_mlp, environment, markdown_table  # noqa: E402

import dask_train as dt  # noqa: E402

HIDDEN = (1024, 1024)
BATCH = 128


def subnormal(t: torch.Tensor) -> int:
    """How many float32 values of ``t`` are subnormal (read from the bits, whatever DAZ says)."""
    bits = t.detach().contiguous().view(torch.int32)
    return int(((bits & 0x7F800000) == 0).logical_and_((bits & 0x7FFFFFFF) != 0).sum())


def about_to(t: torch.Tensor, beta: float = 0.9) -> int:
    """Values one multiplication by ``beta`` makes subnormal: tiny <= |x| < tiny / beta."""
    tiny = torch.finfo(torch.float32).tiny
    a = t.detach().abs()
    return int(((a >= tiny) & (a < tiny / beta)).sum())


# -- in this process -------------------------------------------------------------------------------


def _state_counts(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  states: Sequence[dict[str, torch.Tensor]]) -> dict[str, int]:
    return {
        "param": sum(subnormal(p) for p in params),
        "grad": sum(subnormal(g) for g in grads),
        "grad == 0": sum(int((g == 0).sum()) for g in grads),
        "exp_avg": sum(subnormal(s["exp_avg"]) for s in states),
        "exp_avg == 0": sum(int((s["exp_avg"] == 0).sum()) for s in states),
        "exp_avg next": sum(about_to(s["exp_avg"]) for s in states),
        "exp_avg_sq": sum(subnormal(s["exp_avg_sq"]) for s in states),
    }


def local_run(runner: str, X: torch.Tensor, y: torch.Tensor, *, steps: int, every: int
              ) -> tuple[list[dict[str, Any]], Any]:
    """One loop of ``steps`` steps; its counts every ``every`` steps, and the FlatOptimizer of
    dask-train's runner (None for the others)."""
    from dask_train.engines.holders.optim import FlatOptimizer
    from dask_train.policy._settings import OptimizerSettings

    net = build_mlp(HIDDEN)
    params = list(net.parameters())
    gen = torch.Generator().manual_seed(0)
    flat: FlatOptimizer | None = None
    if runner == "dask-train FlatOptimizer":
        vector = torch.nn.utils.parameters_to_vector(params).detach().numpy()
        flat = FlatOptimizer(vector, OptimizerSettings("adam", 1e-3))
        # The module's parameters become views of the shard's, as a sync rank's are.
        torch.nn.utils.vector_to_parameters(flat.param.detach(), params)
        for p, view in zip(params, _views(flat.grad, params)):
            p.grad = view
    else:
        opt = torch.optim.Adam(params, lr=1e-3, fused=runner.endswith("fused=True"))
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(X), (BATCH,), generator=gen)
        if flat is None:
            opt.zero_grad(set_to_none=True)
        else:
            flat.grad.zero_()  # a trainer's gradient buffer: zeroed, then backward adds into it
        torch.nn.functional.cross_entropy(net(X[idx]), y[idx]).backward()
        if flat is None:
            opt.step()
        else:
            with torch.no_grad():
                flat.step(BATCH)
        if step % every == 0:
            if flat is None:
                counts = _state_counts(params, [p.grad for p in params],
                                       [opt.state[p] for p in params])
            else:
                counts = _state_counts([flat.param], [flat.grad],
                                       [flat.optimizer.state[flat.param]])
            rows.append({"runner": runner, "step": step,
                         "wall_s": round(time.perf_counter() - started, 1), **counts})
            print(rows[-1], file=sys.stderr, flush=True)
    return rows, flat


def kernel_costs(flat: Any, *, reps: int) -> list[dict[str, Any]]:
    """One Adam step over the flat vector from the state ``flat`` (a FlatOptimizer) reached, as
    it is and with its subnormal values set to 0 (what FTZ/DAZ would have made of them), by
    torch's fused kernel (what dask-train steps) and by its per-tensor loop (plain torch's CPU
    default); each step from a fresh copy of the state, the four interleaved ``reps`` times and
    the median kept, so a load that comes and goes weighs on all four alike."""
    param, grad = flat.param.detach(), flat.grad.detach()
    state = flat.optimizer.state[flat.param]
    tiny = torch.finfo(torch.float32).tiny
    states = {"as trained": {k: v.clone() for k, v in state.items()}}
    states["subnormals set to 0"] = {
        k: v.masked_fill(v.abs() < tiny, 0.0) if v.dim() else v.clone() for k, v in state.items()}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(reps):
        for label, held in states.items():
            for kernel in ("fused (dask-train)", "per-tensor (torch default)"):
                p = torch.nn.Parameter(param.clone())
                p.grad = grad.clone()
                opt = torch.optim.Adam([p], lr=1e-3, fused=kernel.startswith("fused"),
                                       foreach=False if not kernel.startswith("fused") else None)
                opt.state[p] = {k: v.clone() for k, v in held.items()}
                t0 = time.perf_counter()
                opt.step()
                times.setdefault((kernel, label), []).append(time.perf_counter() - t0)
    rows = []
    for (kernel, label), values in times.items():
        rows.append({"kernel": kernel, "state": label,
                     "exp_avg subnormal": subnormal(states[label]["exp_avg"]),
                     "median step ms": round(1e3 * float(np.median(values)), 2)})
    for kernel in ("fused (dask-train)", "per-tensor (torch default)"):
        slow, fast = (r["median step ms"] for r in rows if r["kernel"] == kernel)
        for r in rows:
            if r["kernel"] == kernel:
                r["with / without subnormals"] = f"{slow / fast:.2f}x"
    return rows


def _views(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for p in params:
        out.append(flat[offset: offset + p.numel()].view_as(p))
        offset += p.numel()
    return out


# -- in a real async-ps job ------------------------------------------------------------------------


def _set_flag(value: bool) -> None:
    dask.config.set({"dask-train.flush-denormal": value})


def _count_on_worker(dask_worker: Any) -> dict[str, Any]:
    """On one worker: counts in every shard it serves and every trainer loop running there."""
    from dask_train.engines.holders.shard import ShardServer
    from dask_train.engines.ps.trainer import _Pusher
    from dask_train.runtime._plugin import worker_state

    out: dict[str, Any] = {}
    for job in list(worker_state(dask_worker).jobs.values()):
        for shard in list(job.params.values()):
            if isinstance(shard, ShardServer) and not shard.attached:
                state = shard.optimizer.state.get(shard.param, {})
                out["server"] = {
                    "step": shard.version, "param": subnormal(shard.param),
                    "exp_avg": subnormal(state["exp_avg"]) if state else 0,
                    "exp_avg == 0": int((state["exp_avg"] == 0).sum()) if state else 0,
                    "exp_avg_sq": subnormal(state["exp_avg_sq"]) if state else 0}
    # A trainer's loop keeps its gradient buffers on its _Pusher: found among live objects (a
    # diagnostic only; nothing of the library holds a registry of them).
    pushers = [o for o in gc.get_objects() if isinstance(o, _Pusher)]
    for i, pusher in enumerate(pushers):
        current = pusher.pushes % len(pusher.buffers)
        for j, buf in enumerate(pusher.buffers):
            bits = buf.view(torch.int32)
            where = torch.nonzero(((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFFFF) != 0))
            out[f"trainer{i} buffer{j}{' (filling)' if j == current else ''}"] = {
                "step": pusher.pushes, "grad": int(where.numel()),
                "grad == 0": int((buf == 0).sum()),
                "first": int(where.min()) if where.numel() else -1,
                "last": int(where.max()) if where.numel() else -1}
        out[f"trainer{i} model"] = {"param": subnormal(pusher.model.flat)}
    return out


def cluster_run(seconds: float, n_samples: int) -> list[dict[str, Any]]:
    """An async-ps job with the flag off, counted every 4 s from a thread of this client."""
    client = dt.connect(n_workers=2, quiet=True)
    rows: list[dict[str, Any]] = []
    try:
        client.run(_set_flag, False)
        X, y = client.persist(list(dt.datasets.digits(n_samples, seed=0)))
        done = threading.Event()
        started = time.perf_counter()

        def watch() -> None:
            while not done.wait(4.0):
                for worker, found in client.run(_count_on_worker).items():
                    for place, counts in found.items():
                        rows.append({"t_s": round(time.perf_counter() - started),
                                     "worker": worker.rsplit(":", 1)[-1], "place": place,
                                     **counts})
                        print(rows[-1], file=sys.stderr, flush=True)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        result = dt.Trainer(build_mlp(HIDDEN), optimizer="adam", lr=1e-3, strategy="async-ps",
                            ps=1, workers=2, scorer=0, batch_size=BATCH, epochs=1000,
                            progress=False, client=client,
                            stop=[dt.StopAfter(seconds=seconds)]).fit(X, y)
        done.set()
        watcher.join()
        print(f"async-ps: {result.steps} steps, {result.samples / result.wall_s:,.0f} samples/s "
              f"end to end", file=sys.stderr)
        client.run(_set_flag, True)
    finally:
        client.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--n-samples", type=int, default=200_000)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--parts", default="local,cluster")
    args = parser.parse_args(argv)
    env = environment()
    print(f"CPU: {env['cpu']}, torch {env['torch']}, {env['date']}, load {env['loadavg_at_start']}")
    torch.set_flush_denormal(False)
    torch.set_num_threads(1)
    if "local" in args.parts:
        X_np, y_np = dask.compute(*dt.datasets.digits(args.n_samples, seed=0))
        X, y = torch.from_numpy(np.asarray(X_np)), torch.from_numpy(np.asarray(y_np))
        rows, flat = [], None
        for runner in ("torch Adam (default)", "torch Adam fused=True",
                       "dask-train FlatOptimizer"):
            counted, flat = local_run(runner, X, y, steps=args.steps, every=args.every)
            rows += counted
        columns = ["runner", "step", "wall_s", "param", "grad", "grad == 0", "exp_avg",
                   "exp_avg == 0", "exp_avg next", "exp_avg_sq"]
        print(markdown_table([{k: f"{v:,}" if isinstance(v, int) else v for k, v in r.items()}
                              for r in rows], columns))
        costs = kernel_costs(flat, reps=args.reps)
        print(markdown_table([{k: f"{v:,}" if isinstance(v, int) else v for k, v in r.items()}
                              for r in costs], list(costs[0])))
    if "cluster" in args.parts:
        rows = cluster_run(args.seconds, args.n_samples)
        columns = ["t_s", "worker", "place", "step", "param", "grad", "grad == 0", "exp_avg",
                   "exp_avg == 0", "exp_avg_sq", "first", "last"]
        print(markdown_table([{k: f"{v:,}" if isinstance(v, int) and k != "t_s" else v
                               for k, v in r.items()} for r in rows], columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
