"""Module buffers (BatchNorm running statistics) are trained, scored, returned and checkpointed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import Client

import dask_train as dt
from dask_train.checkpoint import CheckpointStore, load_shard
from dask_train.policy._settings import OptimizerSettings


def bn_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )


@pytest.fixture(scope="module")
def digits() -> tuple:
    X, y = dt.datasets.digits(20_000, seed=0, chunks=5_000)
    return X, y, dt.datasets.digits_test()


def _accuracy(module: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    module.eval()
    with torch.no_grad():
        return float((module(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


@pytest.mark.parametrize(
    ("strategy", "ps"), [("async-ps", 1), ("sync", 0)], ids=["async-ps", "sync"]
)
def test_batchnorm_model_trains_scores_and_returns_its_buffers(
    client: Client, digits: tuple, strategy: str, ps: int
) -> None:
    X, y, (xv, yv) = digits
    trainer = dt.Trainer(
        bn_mlp(), strategy=strategy, ps=ps, workers=2, lr=3e-3, optimizer="adam", batch_size=64,
        epochs=2, score_every=0.5, progress=False, timeout=60, client=client,
    )
    result = trainer.fit(X, y, validation=(xv, yv))
    bn = result.model[1]
    # Before the fix the buffers never left the trainers: running_mean stayed 0 and the held-out
    # accuracy in eval mode was about 0.22.
    assert bn.running_mean.abs().sum() > 0
    assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
    assert int(bn.num_batches_tracked) > 0
    assert bn.num_batches_tracked.dtype == torch.int64
    last = result.history.iloc[-1]
    assert last["accuracy"] >= 0.9
    # The scorer evaluated the very model returned, buffers included.
    assert _accuracy(result.model, xv, yv) == pytest.approx(last["accuracy"], abs=0.02)


@pytest.mark.parametrize("strategy", ["async-ps", "sync"])
def test_checkpoint_carries_buffers_and_resume_starts_from_them(
    client: Client, digits: tuple, tmp_path: Path, strategy: str
) -> None:
    from dask_train.models._buffers import BufferSet

    X, y, _ = digits
    config = dt.CheckpointConfig(str(tmp_path), every_seconds=None, every_steps=None, keep=5)

    def trainer(steps: int) -> dt.Trainer:
        return dt.Trainer(
            bn_mlp(), strategy=strategy, ps=1 if strategy == "async-ps" else 0, workers=1,
            scorer=0, lr=1e-3, optimizer="adam", batch_size=64, epochs=3, prefetch=0, seed=3,
            stop=[dt.StopAtStep(steps)], progress=False, timeout=60, client=client,
            checkpoint=config,
        )

    first = trainer(60).fit(X, y)
    store = CheckpointStore(config)
    [directory] = store.complete()
    files = sorted(Path(directory).glob("*.safetensors"))
    saved = [s.buffers for s in map(load_shard, files) if s.buffers is not None]
    assert len(saved) == 1  # one holder keeps them
    checkpointed = saved[0]
    # The checkpoint holds the returned model's buffers (the final checkpoint is the end state).
    returned = BufferSet(first.model).gather()
    assert returned is not None
    np.testing.assert_array_equal(checkpointed.numpy(), returned)
    assert checkpointed[-1] > 0  # num_batches_tracked, the last buffer

    # Resume for zero further steps: the buffers handed back are exactly the checkpointed ones.
    resumed = trainer(60).fit(X, y, resume=True)
    assert resumed.steps == 60
    np.testing.assert_array_equal(BufferSet(resumed.model).gather(), checkpointed.numpy())
    # And training on from them moves them on: the counter continues from the checkpoint's.
    further = trainer(90).fit(X, y, resume=True)
    assert int(further.model[1].num_batches_tracked) > int(checkpointed[-1])


def test_buffer_vector_round_trips_int64_counters_exactly() -> None:
    from dask_train.models._buffers import BufferSet

    src, dst = bn_mlp(), bn_mlp(seed=1)
    src[1].running_mean.uniform_()
    src[1].num_batches_tracked.fill_(2**40 + 1)  # past float32's 2**24, within float64's 2**53
    values = BufferSet(src).gather()
    assert values is not None and values.dtype == np.float64
    BufferSet(dst).scatter(values)
    assert dst[1].num_batches_tracked.dtype == torch.int64
    assert int(dst[1].num_batches_tracked) == 2**40 + 1
    torch.testing.assert_close(dst[1].running_mean, src[1].running_mean, rtol=0, atol=0)
    with pytest.raises(ValueError, match="another model"):
        BufferSet(dst).scatter(values[:-1])


def test_a_model_without_buffers_sends_and_keeps_nothing() -> None:
    from dask_train.engines.ps.server import ShardServer
    from dask_train.models._buffers import BufferSet

    linear = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU())
    assert not BufferSet(linear) and BufferSet(linear).gather() is None
    server = ShardServer(np.zeros(10, dtype=np.float32), OptimizerSettings("sgd", 0.1, {}))
    server.apply(np.ones(10, dtype=np.float32), 1, None, BufferSet(linear).gather())
    assert server.pull()[3] is None
