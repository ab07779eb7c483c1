"""An optuna sampler that lets a test decide what each trial of a search runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optuna


class FixedSampler(optuna.samplers.BaseSampler):
    """Trial n takes values[n]: a test decides what each trial runs."""

    def __init__(self, values: Sequence[dict[str, Any]]) -> None:
        self.values = list(values)

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, Any]:
        return {}

    def sample_relative(self, study: Any, trial: Any, search_space: Any) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: Any, trial: Any, name: str, dist: Any) -> Any:
        return self.values[trial.number][name]
