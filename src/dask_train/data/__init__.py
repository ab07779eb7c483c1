"""Data layer: dask collections -> co-located blocks, persisted on the workers or streamed from
storage each epoch -> bounded per-trainer queues -> minibatches (numpy; an engine converts them to
its framework's tensors)."""

from dask_train.data._blocks import BlockSet, as_dask_array, persist_blocks
from dask_train.data._feed import FeedItem, FeedReader, batches, block_order
from dask_train.data._persist import persist_data
from dask_train.data._readers import from_npy
from dask_train.data._xarray import patches

__all__ = [
    "BlockSet",
    "FeedItem",
    "FeedReader",
    "as_dask_array",
    "batches",
    "block_order",
    "from_npy",
    "patches",
    "persist_blocks",
    "persist_data",
]
