"""A Hugging Face ``datasets.Dataset`` given to ``dt.run(data=)`` as it is, on a real cluster of
2 worker processes: its rows in blocks read on the workers (an in-memory Dataset's in Arrow pieces,
a saved one's from its Arrow files by row range, every epoch when streamed), every column a named
array of the batches, each row once per epoch over the 2 ranks (by its id), through
``ctx.batches`` and ``dt.huggingface.dataset``; datasets' other objects and columns that cannot
become arrays named before anything is sent. Nothing is downloaded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Imported, not skipped when missing: make test installs the huggingface extra.
import datasets
import numpy as np
import pytest

import dask_train as dt

ROWS, SEQ = 2_000, 8


def columns(n: int = ROWS) -> dict[str, np.ndarray]:
    """Ids 0..n-1, token ids and a label per row."""
    rng = np.random.default_rng(0)
    return {"id": np.arange(n), "input_ids": rng.integers(0, 50, size=(n, SEQ)),
            "label": (np.arange(n) % 3).astype(np.int64)}


def ids_by_epoch(ctx, epochs=2):
    """Each epoch's ids this rank read with ctx.batches, and what one batch looked like."""
    seen, shape = [], None
    for _epoch in ctx.epochs(epochs):
        ids = []
        for batch in ctx.batches():
            shape = shape or {k: (tuple(v.shape[1:]), str(v.dtype)) for k, v in batch.items()}
            ids += batch["id"].tolist()
        seen.append(ids)
        ctx.report({"rows": float(len(ids))})
    val = ctx.dataset("val")
    return {"ids": seen, "batch": shape, "val": {k: tuple(v.shape) for k, v in val.items()}}


def test_a_dataset_in_memory_gives_each_row_once_per_epoch_over_two_ranks(client):
    ds = datasets.Dataset.from_dict(columns()).shuffle(seed=0)  # an indices mapping over rows
    val = datasets.Dataset.from_dict(columns(100))
    result = dt.run(ids_by_epoch, workers=2, client=client, timeout=60, batch_size=64,
                    data={"train": ds, "val": val})
    ranks = result.returns
    for epoch in range(2):
        both = ranks[0]["ids"][epoch] + ranks[1]["ids"][epoch]
        assert sorted(both) == list(range(ROWS)), epoch  # each row once, over the two ranks
        assert ranks[0]["ids"][epoch] and ranks[1]["ids"][epoch]
    # Every column a named array of the batch, each row's shape and dtype kept: the label a
    # column like the others (no separate targets), as a dict of arrays gives it.
    assert ranks[0]["batch"] == {"id": ((), "torch.int64"), "input_ids": ((SEQ,), "torch.int64"),
                                 "label": ((), "torch.int64")}
    # A Dataset as a named set after the first goes whole to every rank.
    assert ranks[0]["val"] == {"id": (100,), "input_ids": (100, SEQ), "label": (100,)}
    # ROWS rows in 4 blocks (512 a block, the last 464): the same in the ledger.
    consumed = result.ledger.groupby("epoch")["consumed"].sum()
    assert consumed[0] == consumed[1] == ROWS, consumed.to_dict()


def hf_ids_by_epoch(ctx, epochs=2):
    """Each epoch's ids and one batch's keys through dt.huggingface.dataset, as the Trainer reads
    it once prepare_trainer set it up (every rank as many batches)."""
    data = dt.huggingface.dataset(ctx)
    data.start(epochs)
    seen, keys = [], None
    for _ in range(epochs):
        ids = []
        for batch in data.epoch(64):
            keys = keys or {k: str(v.dtype) for k, v in batch.items()}
            ids += batch["id"].tolist()
        seen.append(ids)
    return {"ids": seen, "keys": keys}


def _count_reads() -> None:
    """In a worker: count the reads of a Dataset's blocks (the task's function is looked up by
    name when it is unpickled, so the counted one runs)."""
    import dask_train.data._hf_datasets as module

    original = module.read_rows
    module._reads = []

    def counted(ds, start, stop, columns, packed=False):
        module._reads.append((start, stop, [f["filename"] for f in ds.cache_files]))
        return original(ds, start, stop, columns, packed)

    counted.original = original
    module.read_rows = counted


def _reads() -> list:
    import dask_train.data._hf_datasets as module

    module.read_rows = getattr(module.read_rows, "original", module.read_rows)
    return getattr(module, "_reads", [])


def test_a_dataset_on_disk_is_read_on_the_workers_from_its_files(client, tmp_path):
    datasets.Dataset.from_dict(columns()).save_to_disk(str(tmp_path / "train"))
    ds = datasets.load_from_disk(str(tmp_path / "train"))
    assert ds.cache_files
    client.run(_count_reads)
    try:
        # Streamed: every block read again every epoch, on the worker of the rank reading it.
        result = dt.run(hf_ids_by_epoch, workers=2, client=client, timeout=60,
                        data={"train": ds}, data_mode="stream")
    finally:
        reads = client.run(_reads)
    ranks = result.returns
    for epoch in range(2):
        both = ranks[0]["ids"][epoch] + ranks[1]["ids"][epoch]
        # Each row in the epoch (a rank whose share ran out repeats its last batch: even=True).
        assert set(both) == set(range(ROWS)), epoch
    consumed = result.ledger.groupby("epoch")["consumed"].sum()
    assert consumed[0] == consumed[1] == ROWS, consumed.to_dict()
    # HF's models take the targets as "labels": the "label" column is renamed, as HF's
    # default_data_collator renames it.
    assert ranks[0]["keys"] == {"id": "torch.int64", "input_ids": "torch.int64",
                                "labels": "torch.int64"}
    # The workers read the blocks by row range from the saved Arrow files, each at least once an
    # epoch; the client read none of them.
    ranges = [(a, b) for worker in reads.values() for a, b, _ in worker]
    files = {f for worker in reads.values() for *_, names in worker for f in names}
    assert files and all(f.startswith(str(tmp_path / "train")) for f in files)
    blocks = [(0, 512), (512, 1024), (1024, 1536), (1536, ROWS)]
    assert set(ranges) == set(blocks)
    assert all(ranges.count(b) >= 2 for b in blocks)


def test_a_dataset_on_disk_travels_as_its_files_an_in_memory_one_in_pieces(tmp_path):
    import pickle

    from dask_train.data._hf_datasets import as_arrays

    datasets.Dataset.from_dict(columns()).save_to_disk(str(tmp_path / "train"))
    on_disk = as_arrays(datasets.load_from_disk(str(tmp_path / "train")), name="ds")
    in_memory = as_arrays(datasets.Dataset.from_dict(columns()), name="ds")
    assert on_disk.numblocks == in_memory.numblocks == (4,)
    assert on_disk.dtype.names == ("id", "input_ids", "label")
    one_block = ROWS // 4 * on_disk.dtype.itemsize
    # The graph of the saved one holds its files' paths, not its rows; the in-memory one holds
    # each block's rows once, in that block's task (not the whole table in every task).
    assert len(pickle.dumps(dict(on_disk.dask))) < one_block / 4
    assert len(pickle.dumps(dict(in_memory.dask))) < 4 * 1.5 * one_block
    assert (np.asarray(in_memory.compute(scheduler="sync"))["id"] == np.arange(ROWS)).all()


class NoCluster:
    """A client that fails the test if anything reaches it."""

    def __getattr__(self, name):
        raise AssertionError(f"client.{name} was used: something was sent before the checks")


def noop(ctx):
    return None


def test_datasets_objects_and_columns_that_cannot_be_arrays_are_named_before_anything_runs():
    data = columns(20)
    ds = datasets.Dataset.from_dict(data)
    splits = datasets.DatasetDict({"train": ds, "test": ds})
    text = ds.add_column("text", ["a row"] * 20)
    ragged = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "labels": [0, 1]})
    stream = ds.to_iterable_dataset()
    with pytest.raises(dt.InvalidInput) as info:
        dt.run(noop, client=NoCluster(), data={"train": splits, "val": text})
    problems = info.value.problems
    with pytest.raises(dt.InvalidInput) as more:
        dt.run(noop, client=NoCluster(), data={"train": stream, "val": ragged,
                                              "test": (ds, data["label"])})
    with pytest.raises(dt.InvalidInput) as whole:
        dt.run(noop, client=NoCluster(), data=splits)
    # Every problem at once, each naming the set, what it is and the fix.
    assert len(problems) == 2
    assert "data['train'] is a datasets.DatasetDict of the splits ['train', 'test']" in problems[0]
    assert "dd['train']" in problems[0]
    assert "data['val']: the columns 'text' (string) cannot become arrays" in problems[1]
    assert "ds.remove_columns(['text'])" in problems[1]
    assert len(more.value.problems) == 3
    assert "data['train'] is a datasets.IterableDataset" in more.value.problems[0]
    assert "streaming=True" in more.value.problems[0]
    assert "data['val']: the columns ['input_ids'] hold rows of different lengths" in \
        more.value.problems[1]
    assert "data['test'] is (datasets.Dataset, ndarray)" in more.value.problems[2]
    assert "pass the Dataset alone" in more.value.problems[2]
    assert "data is a datasets.DatasetDict: pass its splits by name" in whole.value.problems[0]
    # from_dataset names the same problems, read the same way.
    with pytest.raises(dt.InvalidInput, match="'text' \\(string\\) cannot become arrays"):
        dt.huggingface.from_dataset(text)


def test_importing_dask_train_and_run_imports_no_datasets():
    code = textwrap.dedent("""
        import json, sys
        import dask_train as dt
        import dask_train.api._run, dask_train.data._hf_datasets
        from dask_train.api._run import check_run
        check_run({"fn": lambda ctx: None, "config": None, "workers": None, "epochs": None,
                   "batch_size": 64, "stop": (), "callbacks": (), "checkpoint": None,
                   "failure": None, "resume": False, "seed": 0, "shuffle": True,
                   "blocks_ahead": "auto", "timeout": 60.0, "device": "auto",
                   "data": {"train": [[1.0, 2.0]]}})
        print(json.dumps(["datasets" in sys.modules, "transformers" in sys.modules]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False]
