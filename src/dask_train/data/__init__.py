"""Data layer: dask collections -> persisted blocks -> bounded per-trainer queues -> minibatches."""

from dask_train.data._blocks import BlockSet, as_dask_array, persist_blocks
from dask_train.data._feed import FeedItem, FeedReader, batches, block_order, feed_block
from dask_train.data._ledger import Assignment, Block, Ledger, LedgerEntry

__all__ = [
    "Assignment",
    "Block",
    "BlockSet",
    "FeedItem",
    "FeedReader",
    "Ledger",
    "LedgerEntry",
    "as_dask_array",
    "batches",
    "block_order",
    "feed_block",
    "persist_blocks",
]
