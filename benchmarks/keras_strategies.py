"""Keras on Dask: ``dt.Trainer`` against TensorFlow's own distribution strategies, same 2 workers.

Usage::

    python benchmarks/keras_strategies.py [--n-samples N] [--target 0.95] [--seconds S] [--quick]

The digits MLP (Keras, 64-100-10, logits, sparse categorical cross-entropy, Adam lr 1e-2, batch
128 per worker or step), trained until held-out accuracy reaches ``--target`` or ``--seconds``
pass, by four runners on ``dt.connect(n_workers=2)``:

* **Trainer async-ps**: ``dt.Trainer(keras_model, strategy="async-ps", ps=1, workers=2,
  scorer=1)``; gradients from ``tf.GradientTape`` pushed to dask-train's parameter servers.
* **Trainer sync**: ``strategy="sync", workers=2``; gradients all-reduced over gloo.
* **TF ParameterServerStrategy**: ``dt.start_tensorflow(client, ps=1, worker=2, scorer=0)``,
  a custom training loop (``ClusterCoordinator.schedule``) in this process, batches cut from the
  persisted blocks, fetched one block ahead; scored here every 0.5 s from the parameter server's
  weights.
* **TF MultiWorkerMirroredStrategy**: one Dask task per worker (``TF_CONFIG`` on ports from the OS)
  running a custom loop over the blocks that live on its worker; both ranks score every 50 steps
  (they hold the same weights, so they stop at the same step). Keras 3 ``model.fit`` fails under
  both TensorFlow strategies, hence custom loops.

Columns: **set-up** is from the call (``fit``, or ``start_tensorflow`` + strategy, or submitting
the ranks) to the first step done, in workers restarted before each runner so every runner pays
its own TensorFlow import; **time to target** is from the same call to the first score at or
above the target; **samples/s** counts training samples over the training time (after set-up).
One run; the numbers move with the machine's load, which is recorded with them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

import numpy as np
from _common import environment, markdown_table, write_results
from distributed import Client, get_worker

import dask_train as dt
from dask_train.data._blocks import persist_pairs
from dask_train.data._cluster import live_workers

LR, BATCH = 1e-2, 128


def build_model() -> Any:
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(100, activation="relu"),
                             keras.layers.Dense(10)])


def accuracy(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Held-out accuracy of the MLP's weights, in numpy (no TensorFlow context needed)."""
    w1, b1, w2, b2 = weights
    return float(np.mean((np.maximum(x @ w1 + b1, 0) @ w2 + b2).argmax(1) == y))


class _Clock(dt.Callback):
    """A Trainer callback that notes when a score first reached the target."""

    def __init__(self, target: float) -> None:
        self.target, self.hit = target, None

    def on_score(self, record: dict[str, Any]) -> None:
        if self.hit is None and record.get("accuracy", 0) >= self.target:
            self.hit = time.perf_counter()


def run_trainer(client: Client, strategy: str, data: Any, args: argparse.Namespace) -> dict:
    import keras

    X, y, x_val, y_val = data
    clock = _Clock(args.target)
    started = time.perf_counter()
    result = dt.Trainer(
        build_model(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer="adam", lr=LR, strategy=strategy, ps=1, workers=2, scorer=1, batch_size=BATCH,
        epochs=1000, score_every=0.5, timeout=300, progress=False, callbacks=[clock],
        stop=[dt.StopAtScore("accuracy", args.target), dt.StopAfter(seconds=args.seconds)],
        client=client).fit(X, y, validation=(x_val, y_val))
    wall = time.perf_counter() - started
    train_s = max(t["busy_s"] for t in result.trainers)
    return {"setup_s": wall - train_s, "train_s": train_s, "samples": result.samples,
            "time_to_target_s": None if clock.hit is None else clock.hit - started,
            "accuracy": accuracy(result.model.get_weights(), x_val, y_val)}


def run_pss(client: Client, data: Any, args: argparse.Namespace) -> dict:
    import keras
    import tensorflow as tf

    X, y, x_val, y_val = data
    futures = client.sync(persist_pairs, client, X, y)
    started = time.perf_counter()
    cluster = dt.start_tensorflow(client, ps=1, worker=2, scorer=0, timeout=300)
    out = _pss_loop(client, cluster, futures, x_val, y_val, started, args, tf, keras)
    gc.collect()  # the coordinator's functions leave the servers before they end
    cluster.close()
    return out


def _pss_loop(client: Client, cluster: Any, futures: list, x_val: np.ndarray, y_val: np.ndarray,
              started: float, args: argparse.Namespace, tf: Any, keras: Any) -> dict:
    strategy = tf.distribute.ParameterServerStrategy(cluster.coordinator_resolver())
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.Adam(LR)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x: Any, y: Any) -> Any:
        def replica(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(replica, args=(x, y))

    rng = np.random.default_rng(0)
    samples, first, hit, scored = 0, None, None, time.perf_counter()
    while hit is None and time.perf_counter() - started < args.seconds:
        for k in rng.permutation(len(futures)):
            # Fetched while the steps scheduled before run on the TensorFlow workers.
            xb, yb = client.gather(futures[int(k)])[:2]
            for i in range(0, len(xb), BATCH):
                result = coordinator.schedule(step, args=(xb[i : i + BATCH], yb[i : i + BATCH]))
                samples += len(xb[i : i + BATCH])
                if first is None:
                    result.fetch()  # the first step done: set-up is over
                    first = time.perf_counter()
                if time.perf_counter() - scored > 0.5:
                    scored = time.perf_counter()
                    if accuracy(model.get_weights(), x_val, y_val) >= args.target:
                        hit = scored
                        break
            if hit is not None or time.perf_counter() - started > args.seconds:
                break
    coordinator.join()
    end = time.perf_counter()
    assert first is not None
    return {"setup_s": first - started, "train_s": end - first, "samples": samples,
            "time_to_target_s": None if hit is None else hit - started,
            "accuracy": accuracy(model.get_weights(), x_val, y_val)}


def _free_port() -> str:
    host = get_worker().address.split("://")[1].rsplit(":", 1)[0]
    with socket.socket() as sock:
        sock.bind(("", 0))
        return f"{host}:{sock.getsockname()[1]}"


def _mwms_rank(tf_config: dict, parts: list, x_val: np.ndarray, y_val: np.ndarray, *,
               target: float, max_steps: int, steps_per_epoch: int) -> dict:
    """One rank of MultiWorkerMirroredStrategy: a custom loop over this worker's blocks."""
    os.environ["TF_CONFIG"] = json.dumps(tf_config)
    import keras
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.Adam(LR)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum")

    @tf.function
    def step(x, y):  # no annotations: AutoGraph cannot resolve them in a task
        def replica(x, y):  # no annotations: AutoGraph cannot resolve them in a task
            with tf.GradientTape() as tape:
                # Summed and divided by the global batch: the optimizer sums over the ranks.
                loss = loss_fn(y, model(x, training=True)) / (2 * BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(replica, args=(x, y))

    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    rng = np.random.default_rng(int(tf_config["task"]["index"]))
    first, hit, steps = None, None, 0
    while steps < max_steps and hit is None:
        order = rng.permutation(len(x))
        for s in range(steps_per_epoch):
            idx = order[s * BATCH : (s + 1) * BATCH]
            step(x[idx], y[idx])
            steps += 1
            if first is None:
                first = time.time()
            if steps % 50 == 0 and accuracy(model.get_weights(), x_val, y_val) >= target:
                hit = time.time()
                break
            if steps >= max_steps:
                break
    return {"first": first, "hit": hit, "end": time.time(), "steps": steps,
            "accuracy": accuracy(model.get_weights(), x_val, y_val)}


def run_mwms(client: Client, data: Any, args: argparse.Namespace) -> dict:
    X, y, x_val, y_val = data
    futures = client.sync(persist_pairs, client, X, y)
    workers = sorted(live_workers(client))
    holders = client.who_has(futures)
    mine = {w: [f for f in futures if w in holders[f.key]] for w in workers}
    sizes = dict(zip([f.key for f in futures], X.chunks[0]))
    rows = {w: sum(sizes[f.key] for f in mine[w]) for w in workers}
    steps_per_epoch = min(rows.values()) // BATCH  # the same on both ranks, or one would hang
    started = time.perf_counter()
    wall0 = time.time()
    ports = [client.submit(_free_port, workers=[w], pure=False).result() for w in workers]
    ranks = [client.submit(
        _mwms_rank, {"cluster": {"worker": ports}, "task": {"type": "worker", "index": i}},
        mine[w], x_val, y_val, target=args.target, max_steps=int(args.seconds * 300),
        steps_per_epoch=steps_per_epoch, workers=[w], allow_other_workers=False, pure=False)
        for i, w in enumerate(workers)]
    out = client.gather(ranks)
    end = time.perf_counter()
    zero = out[0]
    return {"setup_s": zero["first"] - wall0, "train_s": zero["end"] - zero["first"],
            "samples": zero["steps"] * 2 * BATCH,
            "time_to_target_s": None if zero["hit"] is None else zero["hit"] - wall0,
            "accuracy": zero["accuracy"], "wall_s": end - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=400_000)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--quick", action="store_true", help="small data, a short time limit")
    parser.add_argument("--only", default="", help="run the runners whose name contains this")
    args = parser.parse_args()
    if args.quick:
        args.n_samples, args.seconds = 100_000, 60.0
    env = environment()
    client = dt.connect(n_workers=2, quiet=True)
    x_val, y_val = dt.datasets.digits_test()
    runners = {
        "Trainer async-ps (Keras)": lambda data: run_trainer(client, "async-ps", data, args),
        "Trainer sync (Keras)": lambda data: run_trainer(client, "sync", data, args),
        "TF ParameterServerStrategy, custom loop": lambda data: run_pss(client, data, args),
        "TF MultiWorkerMirroredStrategy, custom loop": lambda data: run_mwms(client, data, args),
    }
    rows, raw = [], {}
    try:
        for name, run in [(n, r) for n, r in runners.items() if args.only.lower() in n.lower()]:
            client.restart()  # fresh worker processes: each runner pays its own TensorFlow import
            X, y = dt.datasets.digits(n_samples=args.n_samples, seed=0)
            X, y = client.persist([X, y])
            out = run((X, y, x_val, y_val))
            raw[name] = out
            hit = out["time_to_target_s"]
            rows.append({"runner": name, "samples/s": f"{out['samples'] / out['train_s']:,.0f}",
                         f"time to {args.target}": "not reached" if hit is None else f"{hit:.1f} s",
                         "set-up": f"{out['setup_s']:.1f} s", "samples": f"{out['samples']:,}",
                         "final accuracy": f"{out['accuracy']:.3f}"})
            print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()},
                  flush=True)
    finally:
        client.close()
    columns = ["runner", "samples/s", f"time to {args.target}", "set-up", "samples",
               "final accuracy"]
    table = markdown_table(rows, columns)
    print(table)
    md, js = write_results("keras_strategies", f"{table}\n\nEnvironment: {env}",
                           {"args": vars(args), "environment": env, "runs": raw})
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
