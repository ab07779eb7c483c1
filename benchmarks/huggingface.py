"""Hugging Face's ``Trainer`` on 2 ranks: under ``dt.run``, under ``torchrun``, under Ray Train.

Usage::

    python benchmarks/huggingface.py [--systems dt-run,torchrun,ray,one] [--target 0.99]
                                     [--seeds 0,1,2]

The job (the same for every system): a BERT built from a ``BertConfig`` (hidden 32, 2 layers, 2
heads, vocabulary 12), sequence classification on generated tokens (64 a row; is token 4 more
frequent than token 5?), 20,000 training rows and 1,000 held out, saved once as
``datasets.Dataset`` s on disk before any timing; HF's ``Trainer`` with AdamW at lr 3e-3, 32
rows a rank a step (64 a step over the 2 ranks), evaluation and a checkpoint every 25 steps,
until the held-out accuracy first reaches the target. Each system runs in a fresh Python
process (or, for ``torchrun``, a fresh ``torchrun``), timed from the moment it is started
(interpreter, imports, cluster or process group, data, training, evaluations) until rank 0's
evaluation reaches the target; ``setup`` is the time to the first training step. The script a
user runs under each differs only where the system asks it to:

* ``dt-run``: ``dt.run`` on an embedded cluster of 2 workers that start with torch and
  transformers' ``Trainer`` imported (``dt.connect(imports=...)``): the rows through
  ``dt.huggingface.from_dataset`` (read on the workers) and ``dt.huggingface.dataset``,
  ``prepare_trainer``, ``Report(ctx, checkpoint=True)`` (the checkpoints are the job's) and
  ``StopAtScore("eval_accuracy", target)``.
* ``torchrun``: ``torchrun --nproc-per-node 2`` on the same script with the dataset loaded in
  each process (HF's own sampler splits it) and HF's checkpoints on the local disk.
* ``ray``: Ray Train's ``TorchTrainer`` with 2 CPU workers, the same dataset loaded in each
  worker, ``RayTrainReportCallback`` (its checkpoints in Ray's storage) and
  ``ray.train.huggingface.transformers.prepare_trainer``; skipped when ``ray`` is not
  importable (``--ray-path`` puts a directory on the workers' path, for a Ray installed apart).
* ``one``: the same Trainer in one process with 1 thread, for reference (2 threads on the 2
  busy cores spun: 246 s once).

Every rank runs with one torch thread (torchrun and Dask's nannies set ``OMP_NUM_THREADS=1``;
Ray's workers are given one CPU each). One run each per seed, one after the other; the table is
printed and written to ``results/huggingface.md``. A seed (``--seeds``) sets the model's
initial weights and the order the rows are read in (HF's sampler's, or ``dt.run``'s ``seed=``):
the steps to the target depend on it, by tens of steps, so with several seeds the table also
gives each system's median. Aims (issue 39): ``dt.run`` no slower than
``torchrun``, at least 2x faster than Ray Train.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROWS, HELD, SEQ, VOCAB = 20_000, 1_000, 64, 12
BATCH, EVERY, SAVE_EVERY = 32, 10, 50
SYSTEMS = ("dt-run", "torchrun", "ray", "one")
#: The run's seed, set by the driver for each run (see the module's text).
SEED = int(os.environ.get("HF_BENCH_SEED", "0"))


# -- the data and the model, the same for every system ----------------------------------------------
def tokens(n: int, seed: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, size=(n, SEQ)).astype(np.int64)
    ids[:, 0] = 2  # [CLS]
    return {"input_ids": ids, "label": ((ids == 4).sum(1) > (ids == 5).sum(1)).astype(np.int64)}


def write_data(directory: Path) -> Path:
    """The training and held-out rows as ``datasets.Dataset`` s on disk (once)."""
    import datasets

    marker = directory / f"done-{ROWS}-{SEQ}"
    if not marker.exists():
        shutil.rmtree(directory, ignore_errors=True)
        datasets.Dataset.from_dict(tokens(ROWS, 0)).save_to_disk(str(directory / "train"))
        datasets.Dataset.from_dict(tokens(HELD, 1)).save_to_disk(str(directory / "val"))
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("ok")
    return directory


def make_bert() -> Any:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(SEED)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=SEQ, num_labels=2))


def accuracy(prediction: Any) -> dict[str, float]:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def arguments(output_dir: str, **kwargs: Any) -> Any:
    from transformers import TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return TrainingArguments(**{
        "output_dir": output_dir, "per_device_train_batch_size": BATCH,
        "learning_rate": float(os.environ.get("HF_BENCH_LR", "1e-3")),
        "num_train_epochs": 3, "eval_strategy": "steps", "eval_steps": EVERY,
        "save_strategy": "steps", "save_steps": SAVE_EVERY, "logging_steps": EVERY,
        "report_to": [], "use_cpu": True, "disable_tqdm": True, "dataloader_pin_memory": False,
        "ddp_find_unused_parameters": False, "seed": SEED, **kwargs})


def target_callback(target: float, out: str | None) -> Any:
    """Stops training on every rank at the first evaluation that reaches ``target`` (HF's
    evaluation metrics are gathered, equal on every rank); rank 0 writes when."""
    from transformers import TrainerCallback

    class Target(TrainerCallback):  # type: ignore[misc]
        first_step: float | None = None
        evaluations: list[tuple[int, float]] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.first_step is None:
                self.first_step = time.time()

        def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None,
                        **kwargs: Any) -> None:
            reached = (metrics or {}).get("eval_accuracy", 0.0)
            self.evaluations.append((state.global_step, round(reached, 3)))
            if reached >= target:
                control.should_training_stop = True
                if out and args.process_index == 0:
                    Path(out).write_text(json.dumps({
                        "target": time.time(), "first_step": self.first_step,
                        "step": state.global_step, "accuracy": reached,
                        "evaluations": self.evaluations}))

    return Target()


# -- the systems (each in its own process) -----------------------------------------------------------
def _dt_run_rank(ctx: Any, target: float, out: str) -> Any:
    from transformers import Trainer

    import dask_train as dt

    trainer = Trainer(model=make_bert(), args=arguments(ctx.scratch_dir),
                      train_dataset=dt.huggingface.dataset(ctx),
                      eval_dataset=dt.huggingface.dataset(ctx, "val"), compute_metrics=accuracy,
                      callbacks=[dt.huggingface.Report(ctx, checkpoint=True),
                                 target_callback(target, out)])
    trainer = dt.huggingface.prepare_trainer(trainer)
    trainer.train(resume_from_checkpoint=dt.huggingface.checkpoint_path(ctx))
    return trainer.state.global_step


def run_dt(data: Path, target: float, out: str) -> None:
    import datasets

    import dask_train as dt

    # Started first, as a script does, with what the ranks import (torch, transformers'
    # Trainer): the workers start with it (see dt.connect's imports=; dt.run started without a
    # client finds them itself, but starts the cluster only once the data is read).
    client = dt.connect(n_workers=2, quiet=True, imports=["torch", "transformers:Trainer"])
    train = dt.huggingface.from_dataset(datasets.load_from_disk(str(data / "train")),
                                        inputs=["input_ids"])
    held = datasets.load_from_disk(str(data / "val")).with_format("numpy")[:]  # a dict of arrays
    result = dt.run(_dt_run_rank, workers=2, client=client, config={"target": target, "out": out},
                    data={"train": train, "val": (held["input_ids"], held["label"])},
                    checkpoint=dt.CheckpointConfig(tempfile.mkdtemp(), every_seconds=None),
                    stop=[dt.StopAtScore("eval_accuracy", target)], timeout=300, seed=SEED)
    print(f"dt.run: stopped by {result.stopped_by} at step {result.returns[0]}; "
          f"timings {json.dumps(result.timings)}", flush=True)
    client.close()


def _hf_rows(data: Path) -> tuple[Any, Any]:
    import datasets

    train = datasets.load_from_disk(str(data / "train")).rename_column("label", "labels")
    held = datasets.load_from_disk(str(data / "val")).rename_column("label", "labels")
    return train, held


def run_script(data: Path, target: float, out: str) -> None:
    """The plain script: one process, or one of torchrun's (it reads the torchrun environment)."""
    from transformers import Trainer

    train, held = _hf_rows(data)
    trainer = Trainer(model=make_bert(), args=arguments(tempfile.mkdtemp()), train_dataset=train,
                      eval_dataset=held, compute_metrics=accuracy,
                      callbacks=[target_callback(target, out)])
    trainer.train()


def _ray_loop(config: dict[str, Any]) -> None:
    import ray.train.huggingface.transformers as ray_hf
    from transformers import Trainer

    train, held = _hf_rows(Path(config["data"]))
    trainer = Trainer(model=make_bert(), args=arguments(tempfile.mkdtemp()), train_dataset=train,
                      eval_dataset=held, compute_metrics=accuracy,
                      callbacks=[ray_hf.RayTrainReportCallback(),
                                 target_callback(config["target"], config["out"])])
    trainer = ray_hf.prepare_trainer(trainer)
    trainer.train()


def run_ray(data: Path, target: float, out: str) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    trainer = TorchTrainer(_ray_loop, train_loop_config={"data": str(data), "target": target,
                                                         "out": out},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                        resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(storage_path=tempfile.mkdtemp()))
    trainer.fit()
    ray.shutdown()


# -- the driver --------------------------------------------------------------------------------------
def measure(system: str, data: Path, target: float, ray_path: str | None,
            seed: int = 0) -> dict[str, Any]:
    out = tempfile.mktemp(suffix=".json")
    env = {**os.environ, "HF_BENCH_SEED": str(seed)}
    script = [str(Path(__file__).resolve()), "--as", system, "--data", str(data),
              "--target", str(target), "--out", out]
    if system == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", *script]
    else:
        command = [sys.executable, *script]
    if system == "ray" and ray_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ray_path, env.get("PYTHONPATH")) if p)
    if system == "one":
        env["OMP_NUM_THREADS"] = "1"
    t0 = time.time()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    ended = time.time() - t0
    if not os.path.exists(out):
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"system": system, "seed": seed,
                "error": f"exit {proc.returncode}, no result:\n{tail}"}
    result = json.loads(Path(out).read_text())
    return {"system": system, "seed": seed, "setup_s": result["first_step"] - t0,
            "target_s": result["target"] - t0, "step": result["step"],
            "accuracy": result["accuracy"], "process_s": ended,
            "evaluations": result["evaluations"]}


LABELS = {"dt-run": "dask-train `dt.run` + `dt.huggingface`",
          "torchrun": "`torchrun --nproc-per-node 2`",
          "ray": "Ray Train `TorchTrainer` + `prepare_trainer`",
          "one": "one process, 1 thread (32 rows a step)"}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def table(rows: list[dict[str, Any]], target: float) -> str:
    lines = [f"| system (HF Trainer, 2 ranks) | seed | setup (s) | script start to {target} (s) | "
             "steps | ms a step (evaluations and checkpoints included) | whole process (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {LABELS[r['system']]} | {r['seed']} | failed | | | | |")
            continue
        per_step = 1000 * (r["target_s"] - r["setup_s"]) / max(1, r["step"])
        lines.append(f"| {LABELS[r['system']]} | {r['seed']} | {r['setup_s']:.1f} | "
                     f"{r['target_s']:.1f} | {r['step']} | {per_step:.0f} | "
                     f"{r['process_s']:.1f} |")
    done = [r for r in rows if "error" not in r]
    seeds = sorted({r["seed"] for r in done})
    # Per system, the median over the seeds (the value itself with one seed).
    by = {s: {k: _median([r[k] for r in done if r["system"] == s])
              for k in ("setup_s", "target_s", "step")}
          for s in {r["system"] for r in done}}
    if len(seeds) > 1:
        for s, m in by.items():
            lines.append(f"| {LABELS[s]} | median of {len(seeds)} | {m['setup_s']:.1f} | "
                         f"{m['target_s']:.1f} | {m['step']:g} | | |")
    notes = []
    if "dt-run" in by and "torchrun" in by:
        notes.append(f"dt.run / torchrun: {by['dt-run']['target_s'] / by['torchrun']['target_s']:.2f}x")
    if "dt-run" in by and "ray" in by:
        notes.append(f"Ray Train / dt.run: {by['ray']['target_s'] / by['dt-run']['target_s']:.2f}x")
    return "\n".join(lines) + ("\n\n" + "; ".join(notes) if notes else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="dt-run,torchrun,ray,one")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--seeds", default="0", help="comma-separated: one run per seed")
    parser.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "dask-train-hf-bench"))
    parser.add_argument("--ray-path", default=None,
                        help="a directory holding ray, put on the Ray run's PYTHONPATH")
    parser.add_argument("--as", dest="role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    data = Path(args.data)
    if args.role is not None:  # one system, in its own process
        run = {"dt-run": run_dt, "torchrun": run_script, "one": run_script, "ray": run_ray}
        run[args.role](data, args.target, args.out)
        return
    write_data(data)
    rows = []
    systems = [s for s in args.systems.split(",") if s]
    if "ray" in systems and not _ray_available(args.ray_path):
        print("ray: not importable here; skipped (pip install 'ray[train]', or --ray-path)")
        systems.remove("ray")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    for seed in seeds:  # the systems one after the other for each seed: any drift hits all
        for system in systems:
            row = measure(system, data, args.target, args.ray_path, seed)
            print(json.dumps(row), flush=True)
            rows.append(row)
    text = table(rows, args.target)
    print(text)
    (HERE / "results").mkdir(exist_ok=True)
    command = " ".join(["python benchmarks/huggingface.py", *sys.argv[1:]])
    (HERE / "results" / "huggingface.md").write_text(
        f"{time.strftime('%Y-%m-%d')}, `{command}`, one run each per seed\n\n{text}\n")


def _ray_available(path: str | None) -> bool:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", "import ray.train.huggingface.transformers"],
                          env=env, capture_output=True).returncode == 0


if __name__ == "__main__":
    main()
