"""Sharded state in ``dt.run`` on a real cluster: an FSDP2 model (``fully_shard``, CPU, gloo)
checkpointed on 2 ranks with ``torch.distributed.checkpoint`` and resumed on 1 and on 2 ranks
(DCP splits the state anew); ``ctx.batches(even=True)`` keeps FSDP's per-step collectives in step
over uneven shares."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import dask.array as da
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dask_train as dt
from dask_train.checkpoint import CheckpointStore
from dask_train.errors import RoleFailed


def fsdp_train(ctx, epochs=2, lr=1e-2):
    """FSDP2 as a user writes it, with DCP's state-dict helpers."""
    from torch.distributed.checkpoint import state_dict as sd
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    model_state, optim_state = sd.get_state_dict(net, opt)
    state = ctx.restore({"model": model_state, "optim": optim_state})
    if state is not None:
        sd.set_state_dict(net, opt, model_state_dict=state["model"],
                          optim_state_dict=state["optim"])
    full = sd.StateDictOptions(full_state_dict=True)

    def whole():
        return ({k: v.clone() for k, v in sd.get_model_state_dict(net, options=full).items()},
                {k: v["exp_avg"].clone() for k, v in
                 sd.get_optimizer_state_dict(net, opt, options=full)["state"].items()})

    start, epochs_run, steps = whole(), [], 0
    for epoch in ctx.epochs(epochs):
        for xb, yb in ctx.batches(batch_size=50, even=True):
            opt.zero_grad()
            loss = F.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            steps += 1
        model_state, optim_state = sd.get_state_dict(net, opt)
        ctx.report({"loss": loss.item()}, checkpoint={"model": model_state, "optim": optim_state},
                   sharded=True)
        epochs_run.append(epoch)
    return {"rank": ctx.rank, "world": ctx.world_size, "restored": state is not None,
            "start": start, "end": whole(), "epochs": epochs_run, "steps": steps}


@pytest.fixture(scope="module")
def uneven():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(4_000, 8)).astype("float32")
    y = (X[:, 0] + X[:, 1] > 0).astype("int64")
    chunks = (1_500, 1_000, 500, 500, 250, 250)  # two ranks' shares cannot be even
    return da.from_array(X, chunks=(chunks, 8)), da.from_array(y, chunks=(chunks,))


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def each_epoch_once(result, rows: int, epochs: range) -> None:
    consumed = result.ledger.groupby("epoch")["consumed"].sum()
    assert all(consumed[e] == rows for e in epochs), consumed.to_dict()


def test_fsdp_state_checkpointed_on_two_ranks_resumes_on_one_and_on_two(client, uneven,
                                                                        tmp_path: Path):
    X, y = uneven
    first = dt.run(fsdp_train, workers=2, client=client, data={"train": (X, y)},
                   checkpoint=dt.CheckpointConfig(tmp_path / "ck", keep=1), timeout=90)
    ends = [r["end"] for r in first.returns]
    assert [r["epochs"] for r in first.returns] == [[0, 1], [0, 1]]
    assert first.returns[0]["steps"] == first.returns[1]["steps"]  # even=True
    assert same(ends[0][0], ends[1][0]) and same(ends[0][1], ends[1][1])
    each_epoch_once(first, len(X), range(2))
    # One checkpoint directory (keep=1): the manifest, written last, names the ranks' DCP files.
    newest = Path(first.checkpoint)
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["shards"] == [] and manifest["sharded"]["next_epoch"] == 2
    shards = newest / manifest["sharded"]["dir"]
    assert {p.name for p in shards.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert [p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("ckpt-")] == \
        [newest.name]
    assert not list((tmp_path / "ck" / ".staging").iterdir())  # every staged state adopted
    with pytest.raises(dt.InvalidInput, match="is sharded: load it with torch.distributed"):
        first.load_checkpoint()
    shutil.copytree(tmp_path / "ck", tmp_path / "ck2")

    # One rank: DCP joins the two ranks' shards; training goes on from epoch 2.
    one = dt.run(fsdp_train, workers=1, client=client, data={"train": (X, y)},
                 config={"epochs": 3}, resume=True, timeout=90,
                 checkpoint=dt.CheckpointConfig(tmp_path / "ck", keep=1))
    [alone] = one.returns
    assert alone["restored"] and alone["world"] == 1 and alone["epochs"] == [2]
    assert same(alone["start"][0], ends[0][0]) and same(alone["start"][1], ends[0][1])
    assert not same(alone["end"][0], ends[0][0])
    # Two ranks again, from the same checkpoint.
    two = dt.run(fsdp_train, workers=2, client=client, data={"train": (X, y)},
                 config={"epochs": 3}, resume=True, timeout=90,
                 checkpoint=dt.CheckpointConfig(tmp_path / "ck2", keep=1))
    assert all(r["restored"] and r["epochs"] == [2] for r in two.returns)
    for r in two.returns:
        assert same(r["start"][0], ends[0][0]) and same(r["start"][1], ends[0][1])
    each_epoch_once(two, len(X), range(3))


def test_a_checkpoint_of_data_rechunked_for_two_ranks_resumes_on_one(client, uneven,
                                                                      tmp_path: Path) -> None:
    # Two blocks for two ranks: dt.run cuts them into 8 (fewer than two a rank); one rank
    # alone would keep the two, so the resume cuts the data as the checkpoint's ledger was
    # written (it failed: "the checkpoint's data ledger was written for other data blocks").
    X, y = (a.rechunk({0: 2_000}) for a in uneven)
    assert X.numblocks[0] == 2
    config = dt.CheckpointConfig(tmp_path / "ck", keep=1)
    first = dt.run(fsdp_train, workers=2, client=client, data={"train": (X, y)},
                   checkpoint=config, timeout=90)
    assert first.ledger["block"].nunique() == 8
    ends = first.returns[0]["end"]
    one = dt.run(fsdp_train, workers=1, client=client, data={"train": (X, y)},
                 config={"epochs": 3}, resume=True, timeout=90, checkpoint=config)
    [alone] = one.returns
    assert alone["restored"] and alone["world"] == 1 and alone["epochs"] == [2]
    assert same(alone["start"][0], ends[0]) and same(alone["start"][1], ends[1])
    each_epoch_once(one, len(X), range(3))
    assert one.ledger["block"].nunique() == 8


def test_a_sharded_report_needs_every_ranks_part_and_restore_needs_a_target(client, uneven,
                                                                           tmp_path: Path):
    X, y = uneven

    def half(ctx):
        for _ in ctx.epochs(1):
            for _b in ctx.batches(even=True):
                pass
            state = {"w": torch.zeros(2)} if ctx.rank == 0 else None
            ctx.report({}, checkpoint=state, sharded=True)

    with pytest.raises(RoleFailed, match="passed a state but not every rank did"):
        dt.run(half, workers=2, client=client, data={"train": (X, y)},
               checkpoint=dt.CheckpointConfig(tmp_path / "a"), timeout=60)

    def write(ctx):
        for _ in ctx.epochs(1):
            ctx.report({}, checkpoint={"w": torch.full((4,), float(ctx.rank))}, sharded=True)

    def restore_without_target(ctx):
        return ctx.restore()

    dt.run(write, workers=1, client=client, checkpoint=dt.CheckpointConfig(tmp_path / "b"))
    with pytest.raises(RoleFailed, match="the checkpoint is sharded"):
        dt.run(restore_without_target, workers=1, client=client, resume=True,
               checkpoint=dt.CheckpointConfig(tmp_path / "b"))


def test_a_sharded_state_on_s3_is_committed_by_its_manifest(client, uneven, s3) -> None:
    """On an object store the staged DCP files are copied (no rename there): the manifest,
    written last, lists them with their sizes, and a checkpoint missing one (a copy cut short,
    or a copy of the checkpoint synced manifest first) is not complete, so a resume takes the
    one before."""
    import s3fs

    X, y = uneven
    fs = s3fs.S3FileSystem(**s3)
    config = dt.CheckpointConfig("s3://train/sharded", keep=2, storage_options=s3)
    first = dt.run(fsdp_train, workers=2, client=client, data={"train": (X, y)},
                   checkpoint=config, timeout=90)
    ends = first.returns[0]["end"]
    newest = first.checkpoint.split("://", 1)[1]
    manifest = json.loads(fs.cat_file(f"{newest}/manifest.json"))
    sharded = f"{newest}/{manifest['sharded']['dir']}"
    on_s3 = {p.rsplit("/", 1)[1]: info["size"] for p, info in fs.find(sharded, detail=True).items()}
    assert manifest["sharded"]["files"] == on_s3
    assert set(on_s3) == {".metadata", "__0_0.distcp", "__1_0.distcp"} and all(on_s3.values())
    assert not fs.find("train/sharded/.staging")  # every staged state adopted, none left

    # A later checkpoint whose copy is not whole: its manifest is there, a rank's file is not,
    # and the other is cut short.
    step = int(newest.rsplit("-", 2)[1])
    broken = newest.replace(f"ckpt-{step:012d}", f"ckpt-{step + 100:012d}")
    fs.copy(f"{newest}/", f"{broken}/", recursive=True)
    fs.rm(f"{broken}/{manifest['sharded']['dir']}/__1_0.distcp")
    store = CheckpointStore(config)
    assert store.newest()[0] == first.checkpoint
    fs.copy(f"{sharded}/__1_0.distcp", f"{broken}/{manifest['sharded']['dir']}/__1_0.distcp")
    assert store.newest()[0].endswith(broken.rsplit("/", 1)[1])  # whole again: complete
    fs.pipe(f"{broken}/{manifest['sharded']['dir']}/__1_0.distcp", b"cut short")
    assert store.newest()[0] == first.checkpoint

    # Resumed from S3 (the ranks read DCP's files with the checkpoint's options): the whole one.
    again = dt.run(fsdp_train, workers=2, client=client, data={"train": (X, y)},
                   config={"epochs": 3}, resume=True, timeout=90, checkpoint=config)
    for r in again.returns:
        assert r["restored"] and r["epochs"] == [2]
        assert same(r["start"][0], ends[0]) and same(r["start"][1], ends[1])
