"""The original Dask + TensorFlow workflow, on TensorFlow 2: servers inside Dask workers, data
from dask arrays, a scorer that stops training.

Usage::

    python examples/tensorflow_digits.py [--scheduler ADDR] [--n-samples N] [--target 0.95]

What it does, step by step, as the 2017 blog post "Dask and TensorFlow" did it with TF 1:

1. Prepare data with dask.array: augmented handwritten digits, generated and persisted on the
   workers (``dt.datasets.digits``).
2. ``dt.start_tensorflow(client, ps=1, worker=2, scorer=1)`` stands up one TensorFlow server per
   role inside the Dask worker processes, on ports from the OS.
3. The scorer is a long-running Dask task on the scorer's worker (``TF_CONFIG`` names its role):
   it evaluates the latest weights on the held-out digits and publishes each score as a Dask
   event.
4. This process is the ParameterServerStrategy coordinator (TF 2's form of between-graph
   training): the model's variables live on the parameter server, and each training step is
   dispatched to a TensorFlow worker with its batch. Batches are cut from the dask array's blocks,
   fetched from the workers one block ahead. Every half second the coordinator sends the current
   weights to the scorer; it stops scheduling steps once a score reaches ``--target``.
5. ``close()`` restarts the workers that held servers: a TensorFlow server cannot be stopped.

Why the batches travel through this process: under ParameterServerStrategy the coordinator
dispatches every step and chooses the worker, so a batch is an argument of the step. ``dt.Trainer``
with a Keras model is the alternative that reads each block where it lives (see
docs/tensorflow.md, "TensorFlow and Keras").
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # TensorFlow's INFO lines stay out of the log

import numpy as np
from distributed import Event, Variable, get_worker, secede

import dask_train as dt


def build_model() -> Any:
    """MLP 64-100-10 on 8x8 digits, logits out."""
    import keras

    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(100, activation="relu"),
                             keras.layers.Dense(10)])


def score_loop(x_val: np.ndarray, y_val: np.ndarray, *, weights: str, stop: str, topic: str
               ) -> int:
    """The scorer role (a Dask task): score each new set of weights, publish it as an event."""
    import json

    worker = get_worker()
    secede()  # a long-running task: leave the worker's thread to Dask's own tasks
    role = json.loads(os.environ["TF_CONFIG"])["task"]  # set by cluster.submit for this role
    model = build_model()
    latest, stopped, scored = Variable(weights), Event(stop), 0
    seen = None
    while not stopped.is_set():
        try:
            future = latest.get(timeout=1)  # the newest weights, as a Dask future
        except TimeoutError:
            continue
        if future.key != seen:
            seen = future.key
            model.set_weights(future.result())
            out = np.asarray(model(x_val, training=False))
            accuracy = float(np.mean(out.argmax(1) == y_val))
            worker.log_event(topic, {"weights": seen, "accuracy": accuracy, "role": role})
            scored += 1
        stopped.wait(0.1)
    return scored


def batches(client: Any, X: Any, y: Any, *, batch_size: int, seed: int) -> Any:
    """Shuffled batches of the persisted dask arrays, block by block, epoch after epoch; the
    next block is fetched from its worker while the current one trains."""
    rng = np.random.default_rng(seed)

    def fetch(i: int) -> Any:
        return client.compute([X.blocks[int(i)], y.blocks[int(i)]])

    while True:
        order = rng.permutation(X.numblocks[0])
        ahead = fetch(order[0])
        for k in range(len(order)):
            current, ahead = ahead, fetch(order[k + 1]) if k + 1 < len(order) else None
            xb, yb = client.gather(current)
            rows = rng.permutation(len(xb))
            for i in range(0, len(rows), batch_size):
                yield xb[rows[i : i + batch_size]], yb[rows[i : i + batch_size]]


def coordinate(client: Any, cluster: Any, X: Any, y: Any, scores: list[dict[str, Any]],
               weights: str, args: argparse.Namespace) -> dict[str, Any]:
    """The ParameterServerStrategy coordinator: schedule steps until the scorer says stop.

    Every TensorFlow object lives in this function: once it returns and is collected, the
    coordinator has removed its functions from the servers, before ``close()`` ends them.
    """
    import keras
    import tensorflow as tf

    strategy = tf.distribute.ParameterServerStrategy(cluster.coordinator_resolver())
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():  # the variables live on the parameter server
        model = build_model()
        optimizer = keras.optimizers.Adam(args.lr)
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

    sent: dict[str, list[np.ndarray]] = {}  # weights sent to the scorer, by their Dask key
    samples, steps, published, started = 0, 0, time.perf_counter(), time.perf_counter()
    reached: dict[str, Any] | None = None
    for xb, yb in batches(client, X, y, batch_size=args.batch_size, seed=0):
        coordinator.schedule(step, args=(xb, yb))  # runs on a free TensorFlow worker
        samples, steps = samples + len(xb), steps + 1
        if time.perf_counter() - published > args.score_every:
            published = time.perf_counter()
            current = model.get_weights()  # read from the parameter server
            [future] = client.scatter([current], workers=cluster.dask_spec["scorer"], direct=True)
            sent[future.key] = current
            Variable(weights).set(future)
        reached = next((s for s in scores if s["accuracy"] >= args.target), None)
        if reached is not None or time.perf_counter() - started > args.seconds:
            break
    coordinator.join()
    return {"train_s": time.perf_counter() - started, "samples": samples, "steps": steps,
            "stopped_by_scorer": reached is not None,
            # The weights the scorer scored at the target (or the last ones).
            "weights": sent[reached["weights"]] if reached else model.get_weights()}


def train(client: Any, args: argparse.Namespace) -> dict[str, Any]:
    X, y = dt.datasets.digits(n_samples=args.n_samples, seed=0)
    X, y = client.persist([X, y])
    x_val, y_val = dt.datasets.digits_test()
    started = time.perf_counter()
    cluster = dt.start_tensorflow(client, ps=1, worker=2, scorer=1, timeout=args.timeout)
    tf_spec, dask_spec = cluster
    print("tf_spec  ", tf_spec.as_dict())
    print("dask_spec", dask_spec)
    token = cluster.start_id
    topic, weights, stop = f"scores-{token}", f"weights-{token}", f"stop-{token}"
    scores: list[dict[str, Any]] = []
    client.subscribe_topic(topic, lambda event: scores.append(event[1]))
    scorer = cluster.submit(score_loop, x_val, y_val, role="scorer", weights=weights, stop=stop,
                            topic=topic)
    setup_s = time.perf_counter() - started
    out = coordinate(client, cluster, X, y, scores, weights, args)
    gc.collect()  # the coordinator's TensorFlow objects go while the servers still answer
    Event(stop).set()
    out["scores"] = scorer.result(timeout=args.timeout)
    client.unsubscribe_topic(topic)
    # Check here what the scorer said, on the weights it scored. Before close(): this process's
    # TensorFlow stays connected to the cluster, and registers every new function on it.
    local = build_model()
    local.set_weights(out.pop("weights"))
    out["held_out_accuracy"] = float(np.mean(
        np.asarray(local(x_val, training=False)).argmax(1) == y_val))
    out["scorer_role"] = scores[-1]["role"] if scores else None
    cluster.close()
    return {"setup_s": setup_s, **out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", default=None, help="Dask scheduler (default: embedded)")
    parser.add_argument("--n-samples", type=int, default=400_000)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--seconds", type=float, default=300.0, help="training time limit")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--score-every", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    client = dt.connect(args.scheduler) if args.scheduler else dt.connect(quiet=True)
    try:
        out = train(client, args)
    finally:
        client.close()
    for key, value in out.items():
        print(f"{key:20} {value:.3f}" if isinstance(value, float) else f"{key:20} {value}")
    if not (out["stopped_by_scorer"] and out["held_out_accuracy"] >= args.target):
        raise SystemExit(f"held-out accuracy {out['held_out_accuracy']:.3f} < {args.target}")


if __name__ == "__main__":
    main()
