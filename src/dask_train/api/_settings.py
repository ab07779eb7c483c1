"""A Trainer's parameters as one typed record, the form validation reads them in.

The Trainer keeps its flat scikit-learn-style parameters (``dt.search`` samples them by name,
``get_params``/``set_params`` work on them); :class:`Settings` is their snapshot at ``fit``,
read by attribute, so a misspelt name in a check is an ``AttributeError`` at once instead of a
silent default. The values are the user's, unchecked: the checks in ``_validate`` say what is
wrong with each. Validated, they become the frozen ``JobSpec`` (``_build.job_spec``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Settings:
    """Every ``Trainer.__init__`` parameter, by name (``stop``/``callbacks`` as lists)."""

    module: Any
    loss: Any
    metrics: Any
    optimizer: Any
    lr: Any
    optimizer_options: Any
    strategy: Any
    ps: Any
    workers: Any
    scorer: Any
    batch_size: Any
    global_batch_size: Any
    epochs: Any
    stop: Any
    callbacks: Any
    score_every: Any
    scorer_budget: Any
    shuffle: Any
    seed: Any
    prefetch: Any
    grad_accumulation: Any
    blocks_ahead: Any
    timeout: Any
    progress: Any
    checkpoint: Any
    failure: Any
    on_nan: Any
    device: Any
    mixed_precision: Any
    client: Any

    @classmethod
    def of(cls, trainer: Any) -> Settings:
        """The settings of ``trainer`` now; ``module`` is the model a factory builds."""
        return cls(**{**trainer.get_params(), "module": trainer._model()})

    @classmethod
    def names(cls) -> list[str]:
        """The parameters' names, in ``Trainer.__init__``'s order."""
        return [f.name for f in dataclasses.fields(cls)]
