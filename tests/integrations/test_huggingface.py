"""Hugging Face inside ``dt.run`` on a real cluster: transformers' own ``Trainer`` (its DDP through
accelerate) on 2 ranks, a tiny BERT built from a config on a generated token task, reading the
job's blocks (a ``datasets.Dataset`` on disk, read on the workers): as accurate as the same
Trainer in one process, its logs and evaluations in the job's history, a stop condition on an
evaluation metric ending it on both ranks, every row read once per epoch; a rank's worker
SIGKILLed, and both ranks going on from HF's checkpoint with its global step; and an
``accelerate.Accelerator`` of the user's own working as under ``accelerate launch``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Imported, not skipped when missing: make test installs the huggingface extra.
import datasets
import numpy as np
import pytest
import torch

import dask_train as dt

sys.path.insert(0, str(Path(__file__).parents[1] / "chaos"))
from _faults import alive, kill, killable_cluster  # noqa: E402

SEQ, VOCAB, BATCH = 16, 12, 32


def tokens(n: int, seed: int) -> dict[str, np.ndarray]:
    """Sequences of random tokens after a [CLS] (2); the label says whether token 4 occurs more
    often than token 5: the model must count over the whole sequence."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, size=(n, SEQ)).astype(np.int64)
    ids[:, 0] = 2
    label = ((ids == 4).sum(1) > (ids == 5).sum(1)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "label": label}


def make_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=SEQ, num_labels=2))


def accuracy(prediction):
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def arguments(output_dir, **kwargs):
    from transformers import TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" at each save
    options = {"output_dir": output_dir, "per_device_train_batch_size": BATCH,
               "learning_rate": 3e-3, "logging_steps": 10, "report_to": [], "use_cpu": True,
               "disable_tqdm": True, "dataloader_pin_memory": False,
               "ddp_find_unused_parameters": False, "seed": 0, "save_strategy": "no",
               "eval_strategy": "epoch", **kwargs}
    return TrainingArguments(**options)


def train_bert(ctx, checkpoint=False, **kwargs):
    """A fine-tuning script as a user writes it: the dataset, the callback, prepare_trainer and
    the checkpoint to resume from come from dask-train."""
    from transformers import Trainer

    trainer = Trainer(model=make_bert(), args=arguments(ctx.scratch_dir, **kwargs),
                      train_dataset=dt.huggingface.dataset(ctx),
                      eval_dataset=dt.huggingface.dataset(ctx, "val"), compute_metrics=accuracy,
                      callbacks=[dt.huggingface.Report(ctx, checkpoint=checkpoint)])
    trainer = dt.huggingface.prepare_trainer(trainer)
    path = dt.huggingface.checkpoint_path(ctx)
    start = 0 if path is None else _step_of(path)
    trainer.train(resume_from_checkpoint=path)
    return {"rank": ctx.rank, "world": trainer.args.world_size, "step": trainer.state.global_step,
            "max_steps": trainer.state.max_steps, "from_step": start,
            "own_rng": path is not None and (Path(path) / f"rng_state_{ctx.rank}.pth").is_file(),
            "accuracy": trainer.evaluate()["eval_accuracy"], "resumed_from": path}


def _step_of(path: str) -> int:
    import json

    return int(json.loads((Path(path) / "trainer_state.json").read_text())["global_step"])


@pytest.fixture(scope="module")
def token_data(tmp_path_factory):
    """3,000 training rows as a datasets.Dataset saved on disk (memory-mapped Arrow files the
    workers read themselves), 500 held out."""
    path = tmp_path_factory.mktemp("tokens") / "train"
    datasets.Dataset.from_dict(tokens(3_000, seed=0)).save_to_disk(str(path))
    train = datasets.load_from_disk(str(path))
    held = tokens(500, seed=1)
    val = ({"input_ids": held["input_ids"], "attention_mask": held["attention_mask"]},
           held["label"])
    return train, val


def test_the_trainer_on_two_ranks_is_as_accurate_as_in_one_process(client, token_data, tmp_path):
    train, val = token_data
    X, y = dt.huggingface.from_dataset(train, inputs=["input_ids", "attention_mask"],
                                       rows_per_block=500)
    assert X["input_ids"].numblocks == (6, 1) and y.dtype == np.int64
    result = dt.run(train_bert, workers=2, client=client, timeout=90, epochs=2,
                    config={"num_train_epochs": 2},
                    data={"train": (X, y), "val": val})
    # The same Trainer in this process, on the same rows (HF's own loader and sampler).
    from transformers import Trainer

    rows = [{"input_ids": torch.as_tensor(r["input_ids"]),
             "attention_mask": torch.as_tensor(r["attention_mask"]),
             "labels": torch.as_tensor(r["label"])} for r in train.with_format("numpy")]
    held = [{"input_ids": torch.as_tensor(i), "attention_mask": torch.as_tensor(m),
             "labels": torch.as_tensor(t)}
            for i, m, t in zip(val[0]["input_ids"], val[0]["attention_mask"], val[1])]
    alone = Trainer(model=make_bert(), args=arguments(str(tmp_path), num_train_epochs=2),
                    train_dataset=rows,
                    eval_dataset=held, compute_metrics=accuracy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank has: 2 threads on 2 busy cores spin (30x slower once)
    try:
        alone.train()
    finally:
        torch.set_num_threads(threads)
    one_process = alone.evaluate()["eval_accuracy"]

    # Both ranks are HF's ranks 0 and 1 of 2, equally far: each took half the steps one
    # process takes (3 blocks of 500 rows each an epoch, in 16 batches of at most 32).
    ranks = result.returns
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
    assert ranks[0]["step"] == ranks[1]["step"] == ranks[0]["max_steps"] == 2 * 48
    assert alone.state.global_step == 2 * 94
    assert ranks[0]["accuracy"] == ranks[1]["accuracy"]
    assert ranks[0]["accuracy"] >= one_process - 0.03, (ranks[0]["accuracy"], one_process)
    assert one_process > 0.9
    # What the Trainer logged and evaluated is in the job's history: the loss every 10 steps,
    # the evaluation at each epoch's end, the end of training's summary and the evaluation the
    # function made after training.
    history = result.history
    assert {"loss", "learning_rate", "grad_norm", "eval_accuracy", "eval_loss",
            "train_loss"} <= set(history.columns)
    evaluations = history.dropna(subset=["eval_accuracy"])
    assert list(evaluations["step"]) == [48, 96, 96]
    assert list(history["epoch"].loc[evaluations.index]) == [1.0, 2.0, 2.0]
    assert evaluations["eval_accuracy"].iloc[-1] == ranks[0]["accuracy"]
    assert history["train_loss"].notna().sum() == 1
    losses = history["loss"].dropna()
    assert len(losses) == 9 and losses.iloc[-1] < losses.iloc[0]
    # Each row once per epoch over the two ranks, as ctx.batches reads them.
    consumed = result.ledger.groupby("epoch")["consumed"].sum()
    assert consumed[0] == consumed[1] == 3_000, consumed.to_dict()


def test_a_stop_condition_on_an_evaluation_metric_ends_training_on_every_rank(client, token_data):
    # The datasets.Dataset itself as the training data (its columns, the label among them,
    # read on the workers from its files).
    train, val = token_data
    result = dt.run(train_bert, workers=2, client=client, timeout=90,
                    config={"num_train_epochs": 4, "eval_strategy": "steps", "eval_steps": 10},
                    data={"train": train, "val": val},
                    stop=[dt.StopAtScore("eval_accuracy", 0.8)])
    assert result.stopped_by == "StopAtScore(eval_accuracy>=0.8)"
    evaluations = result.history["eval_accuracy"].dropna()
    assert evaluations.iloc[-1] >= 0.8 and (evaluations.iloc[:-1] < 0.8).all()
    # Both ranks ended after the step of that evaluation, long before the 4 epochs' 192 steps.
    stop_step = int(result.history.dropna(subset=["eval_accuracy"])["step"].iloc[-1])
    assert [r["step"] for r in result.returns] == [stop_step, stop_step]
    assert stop_step < 192


class KillRankOne(dt.Callback):
    """SIGKILLs the worker of rank 1 at the job's fifth score (after two checkpoints)."""

    def __init__(self, client) -> None:
        self.client, self.scores, self.killed = client, 0, ""

    def on_score(self, record) -> None:
        self.scores += 1
        if self.scores == 5 and not self.killed:
            self.killed = sorted(alive(self.client))[1]  # ranks go in address order
            kill(self.client, self.killed)


def test_a_trainer_whose_worker_is_killed_goes_on_from_its_checkpoint(tmp_path, token_data):
    train, val = token_data
    X, y = dt.huggingface.from_dataset(train, inputs=["input_ids", "attention_mask"],
                                       rows_per_block=500)
    with killable_cluster() as own:
        killer = KillRankOne(own)
        result = dt.run(train_bert, workers=2, client=own, timeout=90, callbacks=[killer],
                        config={"num_train_epochs": 2, "checkpoint": True,
                                "save_strategy": "steps", "save_steps": 20},
                        data={"train": (X, y), "val": val}, epochs=2,
                        checkpoint=dt.CheckpointConfig(tmp_path, every_seconds=None, keep=2),
                        failure=dt.FailureConfig(max_failures=1))
    assert killer.killed and result.generations == 2
    [lost] = result.failures
    assert lost["worker"] == killer.killed and lost["action"] == "restart"
    # The new generation went on from HF's checkpoint of step 20 or 40 (saved before the kill),
    # on both ranks, to the same end: the global step went on, not from 0.
    ranks = result.returns
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["from_step"] for r in ranks} <= {20, 40} and len({r["from_step"] for r in ranks}) == 1
    assert all(r["step"] == r["max_steps"] == 96 for r in ranks)
    assert all(r["own_rng"] for r in ranks)  # each rank's RNG state, saved by that rank
    # The checkpoint written back for HF went with each rank's scratch_dir when it returned.
    assert not any(os.path.exists(r["resumed_from"]) for r in ranks)
    assert ranks[0]["accuracy"] > 0.85
    # The history's steps went on from the checkpoint too, and every row was read once per epoch.
    steps = list(result.history["step"])
    assert steps[-1] == 96
    consumed = result.ledger.groupby("epoch")["consumed"].sum()
    assert consumed[0] == consumed[1] == 3_000, consumed.to_dict()


def train_accelerate(ctx, where, accumulate=2):
    """A loop of the user's own with accelerate, as under ``accelerate launch``: an in-memory
    dataset split over the ranks by accelerate, gradient accumulation, a gather, and
    save_state/load_state."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=generator)
    y = x @ torch.arange(1.0, 9.0) + 0.5
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen, losses = 0, []
    for _epoch in range(3):
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb).squeeze(-1), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            seen += len(xb)
            losses.append(accelerator.gather(loss.detach()[None]).mean().item())
    ranks = accelerator.gather(torch.tensor([float(accelerator.process_index)])).tolist()
    accelerator.save_state(where)  # the main process writes, every rank reads (a shared disk)
    accelerator.wait_for_everyone()
    weights = accelerator.unwrap_model(model).weight.detach().clone()
    with torch.no_grad():
        accelerator.unwrap_model(model).weight.zero_()
    accelerator.load_state(where)
    restored = bool(torch.equal(accelerator.unwrap_model(model).weight, weights))
    return {"processes": accelerator.num_processes, "index": accelerator.process_index,
            "ranks": ranks, "seen": seen, "first": losses[0], "last": losses[-1],
            "restored": restored, "weights": weights.flatten().tolist()}


def test_an_accelerator_inside_run_works_as_under_accelerate_launch(client, tmp_path):
    result = dt.run(train_accelerate, workers=2, client=client, timeout=60,
                    config={"where": str(tmp_path)})
    ranks = result.returns
    assert [(r["processes"], r["index"]) for r in ranks] == [(2, 0), (2, 1)]
    assert all(r["ranks"] == [0.0, 1.0] for r in ranks)  # gather: one value from each rank
    assert all(r["seen"] == 3 * 256 for r in ranks)  # accelerate split the rows over the ranks
    assert ranks[0]["weights"] == ranks[1]["weights"]  # DDP kept the replicas equal
    assert all(r["last"] < r["first"] / 10 for r in ranks)
    assert all(r["restored"] for r in ranks)
    # The job's own streamed rows, in blocks: each row once per epoch, the replicas equal.
    x = np.random.default_rng(0).normal(size=(1_000, 8)).astype(np.float32)
    y = (x @ np.arange(1.0, 9.0, dtype=np.float32) + 0.5).astype(np.float32)
    import dask.array as da

    blocks = dt.run(train_accelerate_on_blocks, workers=2, client=client, timeout=60,
                    data={"train": (da.from_array(x, chunks=125), da.from_array(y, chunks=125))})
    assert blocks.returns[0] == blocks.returns[1]
    losses = blocks.history["loss"]
    assert len(losses) == 2 and losses.iloc[1] < losses.iloc[0]
    consumed = blocks.ledger.groupby("epoch")["consumed"].sum()
    assert consumed[0] == consumed[1] == 1_000, consumed.to_dict()
    # A job of one rank in the same worker processes: accelerate reads its group afresh, not the
    # two ranks an earlier job left in its process-wide state.
    [alone] = dt.run(processes, workers=1, client=client, timeout=60).returns
    assert alone == (1, 0)


def train_accelerate_on_blocks(ctx, epochs=2):
    """The job's streamed rows in a loop with accelerate: ctx.batches(even=True) (already split
    over the ranks, so not passed through accelerator.prepare; as many batches on every rank,
    since DDP's backward is a collective), accumulation, and the job's reports."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05))
    for _epoch in ctx.epochs(epochs):
        for xb, yb in ctx.batches(batch_size=16, even=True):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb).squeeze(-1), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        ctx.report({"loss": accelerator.gather(loss.detach()[None]).mean().item()})
    return accelerator.unwrap_model(model).weight.detach().flatten().tolist()


def processes(ctx):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    return accelerator.num_processes, accelerator.process_index


def test_huggingface_parts_name_what_is_wrong():
    with pytest.raises(dt.InvalidInput, match="pass the ctx") as info:
        dt.huggingface.Report(object(), checkpoint="yes", reduce="median")
    assert len(info.value.problems) == 3
    with pytest.raises(dt.InvalidInput, match="pass the ctx"):
        dt.huggingface.dataset(object())
    with pytest.raises(dt.InvalidInput, match="not Hugging Face's"):
        dt.huggingface.checkpoint_path(type("Ctx", (), {"restore": lambda self: {"w": 1},
                                                        "rank": 0})())
    with pytest.raises(dt.InvalidInput, match="different lengths"):
        dt.huggingface.from_dataset(datasets.Dataset.from_dict(
            {"input_ids": [[1, 2], [3]], "label": [0, 1]}))
    from dask_train.huggingface._data import JobDataset

    with pytest.raises(dt.InvalidInput, match="prepare_trainer"):
        iter(JobDataset(object(), "train", inputs="input_ids", labels="labels"))
