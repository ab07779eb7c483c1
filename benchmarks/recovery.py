"""Cost of failures and checkpoints: time lost to a lost trainer and a lost parameter server, and
checkpoint write time and size.

Usage::

    python benchmarks/recovery.py [--n-samples N] [--quick]

On the digits job (async-ps, 2 trainers, 1 parameter server, a scorer every 0.2 s; MLP
64-100-10, batch 128) on ``dt.connect(n_workers=2)``, one run each:

* **trainer death**: the worker of trainer 1 (which also holds the scorer) is SIGKILLed once
  the servers have applied a set number of samples. Reported: seconds from the kill to the
  failure being handled (detection), from the kill to the next score (the replaced scorer
  publishing again), and the training rate before and after (one trainer survives; the
  restarted worker rejoins as a trainer when the nanny brings it back).
* **parameter-server death**: the server's worker is SIGKILLed; checkpoints every 2 s. Reported:
  detection, kill to the first score of the new generation, and samples redone (trained since
  the last checkpoint and lost with the server).
* **departures with notice**: on ``dt.connect(n_workers=3)``, the server's worker, or trainer
  1's, is retired (``client.retire_workers``, as a scale-down does) once the servers have applied
  a set number of samples; no ``checkpoint=`` (the hand-over goes through a scratch directory on
  this machine). Reported: seconds from the retire call until the job recorded it (the
  departure once the next generation is placed; a kill's failure when decided) and until the
  next score, samples trained again, and the same for a SIGKILL of the server's worker on the
  same cluster with a checkpoint every 2 s, for comparison; then the same retire and SIGKILL of
  rank 1 of a sync job (a killed rank's job goes on from the survivor's state).
* **checkpoint writes**: both MLPs of ``throughput.py``, 8 s of training with a checkpoint every
  second: median seconds to reach the pause (every trainer at a consistent point) and to write
  (shards in parallel, then the manifest) while the trainers wait, and size on disk
  (parameters plus Adam's two moments).

Nothing is asserted; tables go to ``benchmarks/results/recovery.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import build_mlp, environment, markdown_table, write_results

import dask_train as dt


class _Killer(dt.Callback):
    def __init__(self, client: Any, victim: str, samples: int) -> None:
        self.pid = client.run(os.getpid, workers=[victim])[victim]
        self.samples = samples
        self.kill_time_s: float | None = None
        self.rate_before = float("nan")
        self.samples_at_kill = 0
        self.records: list[dict[str, Any]] = []

    def on_score(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.kill_time_s is None and record["samples"] >= self.samples:
            rates = [r["samples_per_s"] for r in self.records[-5:] if r["samples_per_s"] > 0]
            self.rate_before = statistics.median(rates) if rates else float("nan")
            os.kill(self.pid, signal.SIGKILL)
            self.kill_time_s = record["time_s"]
            self.samples_at_kill = record["samples"]


def _failure_run(client: Any, kind: str, n_samples: int, kill_at: int) -> dict[str, Any]:
    X, y = dt.datasets.digits(n_samples, seed=0)
    Xv, yv = dt.datasets.digits_test()
    roles = dt.start_roles(client, ps=1, worker=2, scorer=1)
    victim = roles["trainer"][1] if kind == "trainer" else roles["ps"][0]
    killer = _Killer(client, victim, kill_at)
    tmp = tempfile.mkdtemp(prefix="dt-bench-")
    try:
        trainer = dt.Trainer(
            build_mlp([100]), lr=1e-3, ps=1, workers=2, batch_size=128, epochs=2,
            score_every=0.2, progress=False, client=client, callbacks=[killer],
            checkpoint=dt.CheckpointConfig(tmp, every_seconds=2.0, keep=2),
        )
        result = trainer.fit(X, y, validation=(Xv, yv))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    kill = killer.kill_time_s
    assert kill is not None, "the job ended before the kill: raise --n-samples"
    failure = result.failures[0]
    after = result.history[result.history["time_s"] > kill]
    first_score = float(after["time_s"].iloc[0] - kill) if len(after) else float("nan")
    steady = after[after["time_s"] > kill + 2.0]["samples_per_s"]
    row: dict[str, Any] = {
        "failure": f"{kind} death",
        "action": ", ".join(f"{f['role']}: {f['action']}" for f in result.failures),
        "detected_s": round(failure["time_s"] - kill, 2),
        "kill_to_next_score_s": round(first_score, 2),
        "rate_before": round(killer.rate_before),
        "rate_after": round(float(steady.median())) if len(steady) else float("nan"),
        "generations": result.generations,
        "epochs_completed": result.epochs_completed,
        "samples_applied": result.samples,
        "final_accuracy": round(float(result.history["accuracy"].iloc[-1]), 4),
    }
    if kind == "ps":
        row["samples_redone"] = max(0, killer.samples_at_kill - _restored_samples(result, kill))
    return row


def _restored_samples(result: Any, kill: float) -> int:
    # The new generation's first score counts from the checkpoint's sample count.
    after = result.history[result.history["time_s"] > kill]
    return int(after["samples"].iloc[0]) if len(after) else 0


class _Retirer(dt.Callback):
    """Retires (or SIGKILLs) ``victim`` once the servers have applied ``samples`` samples."""

    def __init__(self, client: Any, victim: str, samples: int, *, kill: bool) -> None:
        self.client, self.victim, self.samples, self.kill = client, victim, samples, kill
        self.pid = client.run(os.getpid, workers=[victim])[victim]
        self.at_s: float | None = None  # the job's clock (history's time_s) at the call
        self.at_wall = 0.0

    def on_score(self, record: dict[str, Any]) -> None:
        if self.at_s is None and record["samples"] >= self.samples:
            self.at_s, self.at_wall = record["time_s"], time.time()
            if self.kill:
                os.kill(self.pid, signal.SIGKILL)
            else:
                self.client.retire_workers([self.victim])


def _departure_run(kind: str, n_samples: int, at: int, *, kill: bool) -> dict[str, Any]:
    X, y = dt.datasets.digits(n_samples, seed=0)
    Xv, yv = dt.datasets.digits_test()
    tmp = tempfile.mkdtemp(prefix="dt-bench-")
    sync = kind == "sync rank"
    with dt.connect(n_workers=3) as client:
        roles = dt.start_roles(client, ps=0 if sync else 1, worker=2, scorer=1)
        victim = roles["ps"][0] if kind == "ps" else roles["trainer"][1]
        call = _Retirer(client, victim, at, kill=kill)
        try:
            result = dt.Trainer(
                build_mlp([100]), lr=1e-3, strategy="sync" if sync else "async-ps",
                ps=1, workers=2, batch_size=128, epochs=2,
                score_every=0.2, progress=False, client=client, callbacks=[call],
                checkpoint=dt.CheckpointConfig(tmp, every_seconds=2.0, keep=2) if kill else None,
            ).fit(X, y, validation=(Xv, yv))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    assert call.at_s is not None, "the job ended before the call: raise --n-samples"
    after = result.history[result.history["time_s"] > call.at_s]
    restart = (result.departures or result.failures)[0]
    redone = 0 if result.departures else int(restart.get("redone", 0))
    return {
        "event": f"{kind} {'killed' if kill else 'retired'}",
        "recorded_as": "departure" if result.departures else
        ", ".join(f"{f['role']}: {f['action']} (from {f.get('from', '-')})"
                  for f in result.failures),
        "recorded_s": round(restart["time_s"] - call.at_s, 2),
        "to_next_score_s": round(float(after["time_s"].iloc[0] - call.at_s), 2)
        if len(after) else float("nan"),
        "samples_redone": redone,
        "generations": result.generations,
        "samples_applied": result.samples,
        "final_accuracy": round(float(result.history["accuracy"].iloc[-1]), 4),
    }


def _checkpoint_run(client: Any, hidden: list[int], batch: int, n_samples: int) -> dict[str, Any]:
    X, y = dt.datasets.digits(n_samples, seed=0)
    tmp = tempfile.mkdtemp(prefix="dt-bench-")
    try:
        model = build_mlp(hidden)
        trainer = dt.Trainer(
            model, lr=1e-3, ps=1, workers=2, batch_size=batch, epochs=1, scorer=0,
            stop=[dt.StopAfter(seconds=8)], progress=False, client=client,
            checkpoint=dt.CheckpointConfig(tmp, every_seconds=1.0, keep=2),
        )
        result = trainer.fit(X, y)
        periodic = [c["write_s"] for c in result.checkpoints if not c.get("final")]
        pauses = [c["pause_s"] for c in result.checkpoints if not c.get("final")]
        newest = Path(result.checkpoints[-1]["directory"])
        size = sum(f.stat().st_size for f in newest.iterdir())
        n_params = sum(p.numel() for p in model.parameters())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "model": "MLP " + "-".join(str(h) for h in [64, *hidden, 10]),
        "params": n_params,
        "checkpoints": len(result.checkpoints),
        "median_write_s": round(statistics.median(periodic), 4) if periodic else float("nan"),
        "max_write_s": round(max(periodic), 4) if periodic else float("nan"),
        "median_pause_s": round(statistics.median(pauses), 4) if pauses else float("nan"),
        "size_MB": round(size / 1e6, 2),
        "steps": result.steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-samples", type=int, default=400_000)
    parser.add_argument("--quick", action="store_true", help="smaller data, for a smoke run")
    parser.add_argument("--sections", default="failures,departures,checkpoints",
                        help="which tables to measure (comma-separated)")
    args = parser.parse_args()
    n = 100_000 if args.quick else args.n_samples
    sections = set(args.sections.split(","))
    rows_fail: list[dict[str, Any]] = []
    rows_depart: list[dict[str, Any]] = []
    rows_ckpt: list[dict[str, Any]] = []
    if "failures" in sections:
        for kind in ("trainer", "ps"):
            # A fresh cluster per run: each kills one of its workers.
            with dt.connect(n_workers=2) as client:
                rows_fail.append(_failure_run(client, kind, n, kill_at=n // 3))
                print(rows_fail[-1], flush=True)
    if "departures" in sections:
        for kind, kill in (("ps", False), ("trainer", False), ("ps", True),
                           ("sync rank", False), ("sync rank", True)):
            rows_depart.append(_departure_run(kind, n, n // 3, kill=kill))
            print(rows_depart[-1], flush=True)
    if "checkpoints" in sections:
        with dt.connect(n_workers=2) as client:
            rows_ckpt.append(_checkpoint_run(client, [100], 512, n))
            rows_ckpt.append(_checkpoint_run(client, [1024, 1024], 128, n))
    md = ""
    if rows_fail:
        md += "## Failures (digits job, async-ps, 2 trainers, 1 server)\n\n"
        md += markdown_table(rows_fail, list(dict.fromkeys(k for r in rows_fail for k in r)))
        md += "\n\n"
    if rows_depart:
        md += ("## Departures with notice against a kill (3 workers, 2 trainers: async-ps "
               "with 1 server, or sync)\n\n")
        md += markdown_table(rows_depart, list(rows_depart[0])) + "\n\n"
    if rows_ckpt:
        md += "## Checkpoint writes (every second for 8 s, trainers paused while written)\n\n"
        md += markdown_table(rows_ckpt, list(rows_ckpt[0]))
    print(md)
    name = "recovery-quick" if args.quick else "recovery"
    if sections != {"failures", "departures", "checkpoints"}:
        name += "-" + "-".join(sorted(sections))
    write_results(name, md, {"environment": environment(), "failures": rows_fail,
                             "departures": rows_depart, "checkpoints": rows_ckpt,
                             "args": vars(args)})


if __name__ == "__main__":
    main()
