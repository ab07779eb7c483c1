"""The client's progress bar: samples trained, with the live score."""

from __future__ import annotations

import math
from types import TracebackType
from typing import Any

from tqdm.auto import tqdm


class Progress:
    """A tqdm bar over samples, updated from score records; a no-op when disabled."""

    def __init__(self, *, total: int, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        if enabled:
            self.bar = tqdm(total=total, unit="samples", unit_scale=True, mininterval=0.5,
                            desc="dask-train", dynamic_ncols=True)

    def update(self, record: dict[str, Any]) -> None:
        """Move the bar to ``record["samples"]`` and show its scores."""
        if self.bar is None:
            return
        self.bar.n = min(int(record["samples"]), self.bar.total)
        post = {"step": record["step"], "loss": f"{record['loss']:.4f}"}
        if not math.isnan(record.get("accuracy", math.nan)):
            post["acc"] = f"{record['accuracy']:.4f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.refresh()

    def close(self, reason: str = "") -> None:
        """Close the bar, noting why training stopped."""
        if self.bar is not None:
            if reason:
                self.bar.set_description(f"dask-train ({reason})")
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
