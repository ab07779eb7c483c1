"""Where a parameter holder lives: a plain record the controller's side reads too, so it stays
free of torch (a ``dt.run`` client never imports torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardRef:
    """Where one shard lives: its slice of the flat vector and its worker's address."""

    index: int
    start: int
    stop: int
    address: str
    #: The file name of the shard's segment in host memory (``host_memory``); "" for none.
    segment: str = ""
