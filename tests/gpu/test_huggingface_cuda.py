"""Hugging Face's own ``Trainer`` inside ``dt.run`` on a GPU worker: the script a user brings
(``use_cpu=ctx.device.type == "cpu"``) trains on the worker's GPU, through the process group the
job started (NCCL), from the job's blocks, and its evaluations reach the job's history.

Skipped without CUDA, with the reason; the CPU path is tests/integrations/test_huggingface.py."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import dask.array as da
import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster

import dask_train as dt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine (torch.cuda.is_available() "
                                       "is False); the GPU paths run where one is present")

SEQ, VOCAB = 16, 12


@pytest.fixture(scope="module")
def one_gpu_client() -> Iterator[Client]:
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


def _tokens(n: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    # The label says whether token 4 occurs more often than token 5 (as in the CPU test).
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, size=(n, SEQ)).astype(np.int64)
    ids[:, 0] = 2
    label = ((ids == 4).sum(1) > (ids == 5).sum(1)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}, label


def _accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def _fine_tune(ctx) -> dict:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=SEQ, num_labels=2))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=64,
                             learning_rate=3e-3, num_train_epochs=3, report_to=[],
                             use_cpu=ctx.device.type == "cpu", disable_tqdm=True,
                             save_strategy="no", eval_strategy="epoch", logging_steps=20, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=dt.huggingface.dataset(ctx),
                      eval_dataset=dt.huggingface.dataset(ctx, "val"), compute_metrics=_accuracy,
                      callbacks=[dt.huggingface.Report(ctx)])
    trainer = dt.huggingface.prepare_trainer(trainer)
    trainer.train()
    return {"job_device": str(ctx.device), "hf_device": str(trainer.args.device),
            "weights_on": str(next(trainer.model.parameters()).device),
            "backend": torch.distributed.get_backend(), "step": trainer.state.global_step,
            "accuracy": trainer.evaluate()["eval_accuracy"]}


def test_the_hf_trainer_trains_on_the_workers_gpu(one_gpu_client: Client) -> None:
    x, y = _tokens(6_000, seed=0)
    X = {k: da.from_array(v, chunks=(1_000, SEQ)) for k, v in x.items()}
    result = dt.run(_fine_tune, workers=1, client=one_gpu_client, timeout=120, epochs=3,
                    data={"train": (X, da.from_array(y, chunks=1_000)), "val": _tokens(1_000, 1)})
    (out,) = result.returns
    assert out["job_device"].startswith("cuda") and out["hf_device"].startswith("cuda"), out
    assert out["weights_on"].startswith("cuda") and out["backend"] == "nccl", out
    assert out["accuracy"] > 0.85, out
    assert result.history.dropna(subset=["eval_accuracy"])["eval_accuracy"].iloc[-1] \
        == out["accuracy"]
    assert result.ledger.groupby("epoch")["consumed"].sum().tolist() == [6_000] * 3
