"""Keras 3 models (TensorFlow backend) trained by dt.Trainer with dask-train's own engines."""

from __future__ import annotations

import dask.array as da
import keras
import numpy as np
import pytest
import tensorflow as tf
from distributed import Client

import dask_train as dt


def _mlp(hidden: int = 100) -> keras.Model:
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(hidden, activation="relu"),
                             keras.layers.Dense(10)])


def _accuracy(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.asarray(model(x, training=False)).argmax(1) == y))


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_keras_mlp_reaches_the_target_on_digits(tf_client: Client, strategy: str) -> None:
    X, y = dt.datasets.digits(n_samples=200_000, seed=0, chunks=25_000)
    Xv, yv = dt.datasets.digits_test()
    model = _mlp()
    # The Keras scorer is slow next to the trainers: alone it scores at epochs 0.8 and 1.7 (0.93-0.95,
    # then 0.95-0.97), and on a loaded CI machine the last score of a 2-epoch job came at 0.94. Six
    # epochs leave room for more scores; the score stops the job long before.
    trainer = dt.Trainer(
        model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer="adam",
        lr=1e-2, strategy=strategy, ps=1, workers=2, scorer=1, batch_size=128, epochs=6,
        score_every=0.5, stop=[dt.StopAtScore("accuracy", 0.95), dt.StopAfter(seconds=240)],
        timeout=240, progress=False, client=tf_client)
    result = trainer.fit(X, y, validation=(Xv, yv))
    assert result.stopped_by == "StopAtScore(accuracy>=0.95)"
    assert result.history["accuracy"].iloc[-1] >= 0.95
    # The result is a Keras model holding the scored weights: check it here, in the client.
    assert isinstance(result.model, keras.Model) and result.model is not model
    assert _accuracy(result.model, Xv, yv) >= 0.95
    assert (result.predict(Xv).argmax(1) == yv).mean() >= 0.95
    assert all(t["steps"] > 0 for t in result.trainers)
    assert result.history["step"].is_monotonic_increasing
    # The user's model was copied, never trained in place.
    assert _accuracy(model, Xv, yv) < 0.5


def _bn_model() -> keras.Model:
    """A small classifier with BatchNormalization: its moving statistics are buffers."""
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                             keras.layers.BatchNormalization(), keras.layers.ReLU(),
                             keras.layers.Dense(3)])


def _plain_model() -> keras.Model:
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(3)])


# The plain model with batches of 32 (each 500-row block ends with a batch of 20) against an eager
# loop, as a user writes one. The BatchNormalization model's training is chaotic here: the last
# float32 bit decides where it ends (0.3 apart after 80 steps). So it runs against a compiled loop
# (graph and eager kernels round BN's moments differently), with batches that divide the blocks
# (one traced graph), and a power-of-two learning rate: lr * g is then exact, and the servers'
# torch SGD step rounds p - lr * g as Keras's assign_sub does (other rates differ by an ulp).
@pytest.mark.parametrize("make,batch,lr,compiled",
                         [(_plain_model, 32, 0.05, False), (_bn_model, 50, 2.0**-6, True)],
                         ids=["mlp-eager", "batchnorm-compiled"])
def test_one_keras_trainer_equals_a_gradient_tape_loop(tf_client: Client, make, batch: int,
                                                       lr: float, compiled: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 3))).argmax(axis=1).astype(np.int64)
    model = make()
    start = model.get_weights()
    epochs = 2
    trainer = dt.Trainer(model, loss="sparse_categorical_crossentropy", optimizer="sgd", lr=lr,
                         ps=1, workers=1, scorer=0, batch_size=batch, epochs=epochs,
                         shuffle=False, prefetch=False, timeout=240, progress=False,
                         client=tf_client)
    result = trainer.fit(da.from_array(x, chunks=(500, 8)), da.from_array(y, chunks=500))

    # The same rows in the same order, written here: shuffle=False reads the blocks in index
    # order and each block's rows as stored; a batch never spans two blocks.
    reference = make()
    reference.set_weights(start)
    loss_fn = keras.losses.get("sparse_categorical_crossentropy")

    def step(xb: tf.Tensor, yb: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(yb, reference(xb, training=True)))
        grads = tape.gradient(loss, reference.trainable_weights)
        for v, g in zip(reference.trainable_weights, grads):
            v.assign_sub(lr * g)

    run = tf.function(step, reduce_retracing=True) if compiled else step
    for _ in range(epochs):
        for b in range(0, len(x), 500):
            for i in range(b, b + 500, batch):
                run(x[i : min(i + batch, b + 500)], y[i : min(i + batch, b + 500)])
    assert result.steps == epochs * 4 * -(-500 // batch)  # 4 blocks, ceil(500 / batch) batches
    got, want = result.model.get_weights(), reference.get_weights()
    assert len(got) == len(want) == len(start)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    if compiled:  # BN's moving mean and variance: buffers, trained and returned
        assert not np.allclose(got[4], start[4]) and not np.allclose(got[5], start[5])


def test_keras_checkpoint_resume_equals_an_uninterrupted_run(tf_client: Client, tmp_path) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1200, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 3))).argmax(axis=1).astype(np.int64)
    X, Y = da.from_array(x, chunks=(300, 8)), da.from_array(y, chunks=300)
    model = _bn_model()
    common = dict(loss="sparse_categorical_crossentropy", optimizer="adam", lr=1e-2, ps=1,
                  workers=1, scorer=0, batch_size=50, epochs=2, shuffle=True, seed=3,
                  prefetch=False, timeout=240, progress=False, client=tf_client)
    whole = dt.Trainer(model, **common).fit(X, Y)
    config = dt.CheckpointConfig(str(tmp_path), every_seconds=None, every_steps=10, keep=2)
    first = dt.Trainer(model, stop=[dt.StopAtStep(30)], checkpoint=config, **common).fit(X, Y)
    assert first.steps == 30
    resumed = dt.Trainer(model, checkpoint=config, **common).fit(X, Y, resume=True)
    assert resumed.steps == whole.steps == 48
    for a, b in zip(resumed.model.get_weights(), whole.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_keras_settings_are_checked_before_any_work(tf_client: Client) -> None:
    X, y = dt.datasets.digits(n_samples=1000, seed=0, chunks=500)
    before = set(tf_client.who_has())
    with pytest.raises(dt.InvalidInput) as info:
        dt.Trainer(_mlp(), loss="cross_entropy", device="cuda", mixed_precision="bf16",
                   metrics={"acc": "accuracy"}, ps="auto", client=tf_client).fit(X, y)
    text = str(info.value)
    assert "ps='auto' measures torch modules only" in text
    assert "loss='cross_entropy' is a torch loss name" in text
    assert "sparse_categorical_crossentropy" in text
    assert "device='cuda'" in text
    assert set(tf_client.who_has()) <= before  # nothing was submitted (an earlier test's keys may go)
    with pytest.raises(dt.InvalidInput, match="does not fit|failed on"):
        wrong = keras.Sequential([keras.Input((10,)), keras.layers.Dense(10)])
        dt.Trainer(wrong, loss="sparse_categorical_crossentropy", client=tf_client).fit(X, y)
    with pytest.raises(dt.InvalidInput, match="labels from 0 to 9"):
        three = keras.Sequential([keras.Input((64,)), keras.layers.Dense(3)])
        dt.Trainer(three, loss="sparse_categorical_crossentropy", client=tf_client).fit(X, y)


def test_a_keras_job_writes_tensorboard_summaries(tf_client: Client, tmp_path) -> None:
    """dt.callbacks.TensorBoard takes a Keras job's scores and per-trainer figures as a torch
    job's: the controller writes them, from the events every engine publishes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "monitor"))
    from _tensorboard_read import read_scalars

    # What is checked is the writing, not the accuracy: a short job with a few scores.
    X, y = dt.datasets.digits(n_samples=16_000, seed=0, chunks=4_000)
    Xv, yv = dt.datasets.digits_test()
    runs = tmp_path / "runs"
    result = dt.Trainer(
        _mlp(32), loss="sparse_categorical_crossentropy", optimizer="adam", lr=1e-2, ps=1,
        workers=2, scorer=1, batch_size=64, epochs=1, score_every=0.25, timeout=240,
        progress=False, client=tf_client, callbacks=[dt.callbacks.TensorBoard(runs)],
    ).fit(X, y, validation=(Xv, yv))
    scalars = read_scalars(runs)
    rows = scalars["score/accuracy"]
    assert [step for step, _ in rows] == list(result.history["step"])
    assert [v for _, v in rows] == pytest.approx(list(result.history["accuracy"]), rel=1e-6)
    assert any(tag.startswith("trainer/") and tag.endswith("/samples_per_s") for tag in scalars)
