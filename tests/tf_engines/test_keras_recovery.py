"""A Keras job survives a worker SIGKILLed mid-training, as a torch job does."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import keras
import numpy as np
from distributed import Client

import dask_train as dt

sys.path.insert(0, str(Path(__file__).parents[1] / "controller"))
from test_recovery import _assert_every_sample_once, _data, _KillAt  # noqa: E402


def test_async_keras_trainer_killed_mid_epoch_the_survivor_takes_its_rows(tf_client: Client) -> None:
    X, Y, validation = _data()
    roles = dt.start_roles(tf_client, ps=1, worker=2, scorer=1)
    victim = roles["trainer"][1]  # its process also holds the scorer: one kill, two lost roles
    assert victim not in roles["ps"]
    kill = _KillAt(tf_client, victim, samples=3000)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    started = time.monotonic()
    result = dt.Trainer(model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        lr=1e-2, ps=1, workers=2, batch_size=32, epochs=2, score_every=0.2,
                        timeout=120, progress=False, callbacks=[kill], client=tf_client,
                        ).fit(X, Y, validation=validation)
    assert kill.killed_at is not None, "the job ended before the kill"
    actions = {f["role"]: f["action"] for f in result.failures}
    assert actions == {"trainer-1": "continue", "scorer-0": "replace"}
    _assert_every_sample_once(result, 12_000, 2)
    moved = result.ledger[result.ledger["moved_from"].notna()]
    assert len(moved) and (moved["trainer"] != 1).all()
    assert result.history["accuracy"].iloc[-1] > 0.85
    x_val, y_val = validation
    assert np.mean(np.asarray(result.model(x_val)).argmax(1) == y_val) > 0.85
    assert time.monotonic() - started < 240
