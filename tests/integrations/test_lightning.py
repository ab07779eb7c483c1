"""PyTorch Lightning inside ``dt.run`` on a real cluster: a LightningModule trained with
Lightning's own DDP strategy on 2 ranks, its logged metrics in the job's history, a stop condition
ending it, every row read once per epoch; a rank's worker SIGKILLed mid-run, and every rank going on
from Lightning's checkpoint of the newest epoch."""

from __future__ import annotations

import sys
from pathlib import Path

# Imported, not skipped when missing: make test installs the lightning extra.
import lightning.pytorch as pl  # noqa: E402
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dask_train as dt

sys.path.insert(0, str(Path(__file__).parents[1] / "chaos"))
from _faults import alive, kill, killable_cluster  # noqa: E402


class Digits(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _index):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        # Per epoch, synced at its end: a step's own collective would be fine too (every rank
        # takes as many steps), this is what Lightning recommends.
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, _index):
        x, y = batch
        accuracy = (self(x).argmax(1) == y).float().mean()
        self.log("val_acc", accuracy, sync_dist=True)

    def configure_optimizers(self):
        # Batches of 250 a rank (500 a step over both) at this rate: 24 steps an epoch, 0.9 held
        # out in about 4 epochs (batches of 64 at 3e-3 took 96 steps an epoch and 7 epochs).
        return torch.optim.AdamW(self.parameters(), lr=2e-2)


def train_lightning(ctx, epochs=30):
    """A Lightning script as a user writes it: only the Trainer's plugin, callback and the
    train loader come from dask-train."""
    from torch.utils.data import DataLoader, TensorDataset

    xv, yv = ctx.dataset("val")
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=1, num_nodes=ctx.world_size,
                         max_epochs=epochs, plugins=[dt.lightning.DaskEnvironment()],
                         callbacks=[dt.lightning.Report(ctx)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    module = Digits()
    trainer.fit(module, train_dataloaders=dt.lightning.batches(ctx, batch_size=250),
                val_dataloaders=DataLoader(TensorDataset(xv, yv), batch_size=500))
    return {"rank": trainer.global_rank, "world": trainer.world_size,
            "epochs": trainer.current_epoch, "steps": trainer.global_step}


def test_a_lightning_module_on_two_ranks_reports_and_stops(client):
    X, y = dt.datasets.digits(n_samples=12_000)
    Xv, yv = dt.datasets.digits(n_samples=1_000, seed=7)
    result = dt.run(train_lightning, workers=2, client=client, timeout=90,
                    data={"train": (X.rechunk(1_000), y.rechunk(1_000)),
                          "val": (np.asarray(Xv), np.asarray(yv))},
                    stop=[dt.StopAtScore("val_acc", 0.9)])
    assert result.stopped_by == "StopAtScore(val_acc>=0.9)"
    history = result.history
    # Every epoch's logged metrics reached the history: one row per epoch, the last one the stop.
    assert {"val_acc", "train_loss"} <= set(history.columns)
    assert history["val_acc"].iloc[-1] >= 0.9 and (history["val_acc"].iloc[:-1] < 0.9).all()
    assert history["train_loss"].iloc[-1] < history["train_loss"].iloc[0]
    # Both ranks are Lightning's ranks 0 and 1 of 2, stopped after the same epoch.
    epochs = len(history)
    assert [(r["rank"], r["world"], r["epochs"]) for r in result.returns] == \
        [(0, 2, epochs), (1, 2, epochs)]
    assert result.returns[0]["steps"] == result.returns[1]["steps"]
    consumed = result.ledger.groupby("epoch")["consumed"].sum()
    assert all(consumed[e] == len(X) for e in range(epochs)), consumed.to_dict()


def train_resumable(ctx, epochs=8):
    """As train_lightning, with Lightning's checkpoint reported each epoch and resumed from."""
    from torch.utils.data import DataLoader, TensorDataset

    xv, yv = ctx.dataset("val")
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=1, num_nodes=ctx.world_size,
                         max_epochs=epochs, plugins=[dt.lightning.DaskEnvironment()],
                         callbacks=[dt.lightning.Report(ctx, checkpoint=True)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    path = dt.lightning.checkpoint_path(ctx)
    trainer.fit(Digits(), train_dataloaders=dt.lightning.batches(ctx, batch_size=250),
                val_dataloaders=DataLoader(TensorDataset(xv, yv), batch_size=500), ckpt_path=path)
    return {"rank": trainer.global_rank, "epochs": trainer.current_epoch,
            "steps": trainer.global_step,
            "from_epoch": None if path is None else int(torch.load(path)["epoch"])}


class KillRankOne(dt.Callback):
    """SIGKILLs the worker of rank 1 at the job's third score (after two checkpoints)."""

    def __init__(self, client) -> None:
        self.client, self.scores, self.killed = client, 0, ""

    def on_score(self, record) -> None:
        self.scores += 1
        if self.scores == 3 and not self.killed:
            self.killed = sorted(alive(self.client))[1]  # ranks go in address order
            kill(self.client, self.killed)


def test_a_lightning_job_whose_worker_is_killed_resumes_from_its_checkpoint(tmp_path):
    X, y = dt.datasets.digits(n_samples=12_000)
    Xv, yv = dt.datasets.digits(n_samples=1_000, seed=7)
    with killable_cluster() as own:
        killer = KillRankOne(own)
        result = dt.run(train_resumable, workers=2, client=own, timeout=90, callbacks=[killer],
                        data={"train": (X.rechunk(1_000), y.rechunk(1_000)),
                              "val": (np.asarray(Xv), np.asarray(yv))},
                        checkpoint=dt.CheckpointConfig(tmp_path, every_seconds=None, keep=2),
                        failure=dt.FailureConfig(max_failures=1))
    assert killer.killed and result.generations == 2
    [lost] = result.failures
    assert lost["worker"] == killer.killed and lost["action"] == "restart"
    # Every rank of the new generation went on from Lightning's checkpoint of an epoch reported
    # before the kill, not from scratch, to the same end.
    assert [r["rank"] for r in result.returns] == [0, 1]
    # 24 steps an epoch: 4 batches of 250 from each of a rank's six 1,000-row blocks.
    assert all(r["epochs"] == 8 and r["steps"] == 8 * 24 for r in result.returns)
    assert {r["from_epoch"] for r in result.returns} <= {1, 2}
    assert len({r["from_epoch"] for r in result.returns}) == 1
    consumed = result.ledger.groupby("epoch")["consumed"].sum()
    assert all(consumed[e] == len(X) for e in range(8)), consumed.to_dict()
    assert result.history["val_acc"].iloc[-1] > 0.85


def test_lightning_settings_that_do_not_fit_the_job_are_named():
    env = dt.lightning.DaskEnvironment()
    with pytest.raises(dt.InvalidInput, match=r"devices=2, num_nodes=1\) does not fit"):
        env.validate_settings(2, 1)
    with pytest.raises(dt.InvalidInput, match="pass the ctx"):
        dt.lightning.Report(object())
    with pytest.raises(dt.InvalidInput, match="batch_size=0"):
        dt.lightning.batches(object(), batch_size=0)
    with pytest.raises(dt.InvalidInput, match=r"checkpoint='yes'\): pass True or False"):
        dt.lightning.Report(type("Ctx", (), {"report": print})(), checkpoint="yes")
