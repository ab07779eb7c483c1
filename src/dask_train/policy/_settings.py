"""A job's settings by concern, as small frozen records that check their own values.

A ``Trainer`` keeps its flat scikit-learn parameters (``dt.search`` samples them by name),
``dt.run`` its keyword arguments and the CLI its YAML; each builds these same records, so a value
is checked once, with one wording, whichever door it came through. A record's ``problems()``
lists what is wrong with its values (each naming the value, why, and the fix) instead of raising,
so that whoever builds several reports every problem of the job at once (STYLE 9).

Pure: plain values in, sentences out. The records that need torch (the model and its optimizer)
or the checkpoint layer are built on these in :mod:`dask_train.api._settings`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from dask_train.policy._data_mode import read_ahead
from dask_train.policy._placement import Placement, resource_problems
from dask_train.policy.callbacks import Callback
from dask_train.policy.stop import StopCondition

#: Where roles compute: ``"cuda:N"`` too (see :func:`device_problems`).
DEVICES = ("auto", "cpu", "cuda")
#: ``mixed_precision=`` values.
PRECISIONS = (False, True, "bf16", "fp16")


def is_int(value: object) -> TypeGuard[int]:
    """An integer that is not a bool (numpy integers included)."""
    import numbers

    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def int_at_least(name: str, value: object, low: int, *, also: str = "") -> list[str]:
    """``[problem]`` unless ``value`` is an integer >= ``low``; ``also`` names the other values
    accepted (``"'auto'"``), which the message offers first."""
    if is_int(value) and int(value) >= low:  # type: ignore[call-overload]
        return []
    offer = f"{also} or an integer" if also else "an integer"
    return [f"{name}={value!r} is invalid: use {offer} >= {low}."]


def positive(name: str, value: object) -> list[str]:
    """``[problem]`` unless ``value`` is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        return [f"{name}={value!r} is invalid: use a finite number > 0."]
    return []


def per_trainer_batch(batch_size: int, global_batch_size: int | None, trainers: int) -> int:
    """Rows of one trainer's batch: ``batch_size``, or the global batch split over ``trainers``.

    The one rule every part of a job uses (the job's spec, the cost model's candidates, the
    probes of ``strategy="auto"``).

    Examples
    --------
    >>> per_trainer_batch(128, None, 4), per_trainer_batch(128, 512, 4)
    (128, 128)
    """
    if global_batch_size is None:
        return int(batch_size)
    return max(1, int(global_batch_size) // max(1, int(trainers)))


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer that steps a job's parameters, as one record wherever it travels (a
    server's shard, a sync rank, a measurement): ``name`` is a name from
    ``dask_train.models.OPTIMIZERS`` or a ``torch.optim.Optimizer`` subclass, ``options`` its
    other keyword arguments (momentum, betas, weight_decay, ...)."""

    name: str | type = "adam"
    lr: float = 1e-3
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The optimizer as a manifest or a page names it."""
        return self.name if isinstance(self.name, str) else self.name.__name__


@dataclass(frozen=True)
class DataSettings:
    """How the training data is cut and fed: rows per batch, passes, order, read-ahead.

    ``epochs=None`` is ``dt.run``'s "the function says" (``ctx.epochs(n)``).
    """

    batch_size: int = 128
    global_batch_size: int | None = None
    epochs: int | None = 1
    shuffle: bool = True
    seed: int = 0
    blocks_ahead: int | str = "auto"  # a count, or "auto"

    def problems(self, *, trainers: Any = None) -> list[str]:
        """What is wrong with these values; ``trainers``: the count ``global_batch_size`` must
        split over (None: not known yet)."""
        problems = int_at_least("batch_size", self.batch_size, 1)
        problems += self._global_batch_problems(trainers)
        if self.epochs is not None:
            problems += int_at_least("epochs", self.epochs, 1)
        problems += int_at_least("seed", self.seed, 0)
        if not (isinstance(self.blocks_ahead, str) and self.blocks_ahead == "auto"):
            problems += int_at_least("blocks_ahead", self.blocks_ahead, 1, also="'auto'")
        return problems

    def _global_batch_problems(self, trainers: Any) -> list[str]:
        global_batch = self.global_batch_size
        if global_batch is None:
            return []
        problems = int_at_least("global_batch_size", global_batch, 1)
        if problems or not is_int(trainers) or trainers < 1:
            return problems
        if self.batch_size != DataSettings.batch_size:
            problems.append(f"batch_size={self.batch_size!r} and global_batch_size="
                            f"{global_batch!r} are both given: pass one (batch_size is per "
                            "trainer).")
        if global_batch % trainers:
            problems.append(f"global_batch_size={global_batch} does not split evenly over "
                            f"workers={trainers}: use a multiple of {trainers}, e.g. "
                            f"{max(trainers, global_batch - global_batch % trainers)}.")
        return problems

    def per_trainer_batch(self, trainers: int) -> int:
        """Rows of each trainer's batch when ``trainers`` run (:func:`per_trainer_batch`)."""
        return per_trainer_batch(self.batch_size, self.global_batch_size, trainers)

    def read_ahead(self) -> tuple[int, int]:
        """``(blocks granted ahead at the start, the most they may grow to)``."""
        return read_ahead(self.blocks_ahead)


def device_problems(device: Any, mixed_precision: Any = False) -> list[str]:
    """Problems with ``device=`` and ``mixed_precision=`` (whether the workers have GPUs is
    checked on the cluster, see ``runtime.probe_devices``)."""
    problems = []
    if not (device in DEVICES or (isinstance(device, str) and device.startswith("cuda:")
                                  and device[5:].isdigit())):
        problems.append(f"device={device!r} is invalid: use 'auto' (a GPU per worker when every "
                        "worker has one), 'cpu', 'cuda' or 'cuda:N'.")
    if not any(mixed_precision is p or mixed_precision == p for p in PRECISIONS) \
            or isinstance(mixed_precision, (int, float)) and not isinstance(mixed_precision, bool):
        problems.append(f"mixed_precision={mixed_precision!r} is invalid: use False, True (bf16 "
                        "where supported, else fp16 with loss scaling), 'bf16' or 'fp16'.")
    return problems


@dataclass(frozen=True)
class ClusterSettings:
    """Where a job runs: its trainers (ranks), the device they compute on, and the longest any
    single wait may take.

    ``workers`` is a count; where ``ranges`` is allowed (``dt.run``, the Trainer's fixed
    strategies) also ``(least, most)``, or None for every worker: the job starts with as many
    trainers as there are workers within the bounds, and takes in workers that join up to most.
    """

    workers: int | tuple[int, int] | None = 2
    device: str = "auto"
    mixed_precision: bool | str = False
    timeout: float = 60.0
    #: Dask worker resources each trainer (rank) holds, ``{"GPU": 1}``; None: any worker.
    resources: Mapping[str, float] | None = None

    def problems(self, *, ranges: bool = False) -> list[str]:
        """What is wrong with these values; ``ranges``: ``(least, most)`` and None are allowed."""
        w = self.workers
        if ranges:
            if not (w is None or is_int(w) and w >= 1 or isinstance(w, tuple) and len(w) == 2
                    and all(is_int(v) and v >= 1 for v in w) and w[0] <= w[1]):
                problems = [f"workers={w!r} is invalid: pass a number of ranks >= 1, (least, "
                            "most) with 1 <= least <= most, or None for every worker."]
            else:
                problems = []
        else:
            problems = int_at_least("workers", w, 1)
        problems += device_problems(self.device, self.mixed_precision)
        problems += positive("timeout", self.timeout)
        problems += resource_problems(self.resources)
        return problems

    @property
    def placement(self) -> Placement:
        """Where the trainers may run (:class:`~dask_train.policy._placement.Placement`);
        call after :meth:`problems` found none."""
        return Placement.of(self.resources)

    @property
    def ranged(self) -> bool:
        """Whether ``workers`` is ``(least, most)`` or None rather than a count."""
        return self.workers is None or isinstance(self.workers, tuple)

    def trainers(self, cluster_size: int) -> int:
        """The trainers a job starts with on ``cluster_size`` workers: the count given, or as
        many as there are workers within ``(least, most)`` (None: every worker)."""
        least, most = self.bounds(cluster_size)
        return max(least, min(most, int(cluster_size)))

    def most(self) -> int | None:
        """The most trainers workers that join may bring a job to; None: no bound (every
        worker)."""
        return None if self.workers is None else self.bounds(0)[1]

    def bounds(self, cluster_size: int) -> tuple[int, int]:
        """``(least, most)`` trainers: a count is both; None is one up to the cluster's size."""
        if self.workers is None:
            return 1, max(1, int(cluster_size))
        if isinstance(self.workers, tuple):
            return int(self.workers[0]), int(self.workers[1])
        return int(self.workers), int(self.workers)


@dataclass(frozen=True)
class ScoringSettings:
    """The scorer: whether there is one, how often it scores, the share of a core it may take."""

    scorer: int = 1
    score_every: float = 1.0
    scorer_budget: float | str | None = "auto"  # a share of a core, "auto", None

    def problems(self) -> list[str]:
        """What is wrong with these values."""
        problems = []
        if not is_int(self.scorer) or not 0 <= self.scorer <= 1:
            problems.append(f"scorer={self.scorer!r} is invalid: use 0 (no scoring) or 1.")
        problems += positive("score_every", self.score_every)
        budget = self.scorer_budget
        if not (budget is None or isinstance(budget, str) and budget == "auto") and \
                (isinstance(budget, bool) or positive("scorer_budget", budget)):
            problems.append(f"scorer_budget={budget!r} is invalid: use 'auto' (1/(workers + 1) "
                            "of a core), a share of one core > 0 (e.g. 0.25), or None (no "
                            "limit).")
        return problems

    def budget(self, trainers: int) -> float | None:
        """The scorer's share of one core: ``"auto"`` is ``1 / (trainers + 1)``, what each role
        would get of one core it shared with every trainer; None: no limit."""
        if self.scorer_budget is None:
            return None
        if self.scorer_budget == "auto":
            return 1.0 / (max(1, int(trainers)) + 1)
        return float(self.scorer_budget)


def stop_problems(stop: Sequence[Any]) -> list[str]:
    """Entries of ``stop=`` that are not stop conditions."""
    return [f"stop[{i}]={cond!r} is invalid: use dt.StopAtScore, dt.StopAtStep, dt.StopAfter "
            "or dt.EarlyStopping." for i, cond in enumerate(stop)
            if not isinstance(cond, StopCondition)]


def callback_problems(callbacks: Sequence[Any]) -> list[str]:
    """Entries of ``callbacks=`` that are not callbacks."""
    return [f"callbacks[{i}]={cb!r} is invalid: subclass dt.Callback."
            for i, cb in enumerate(callbacks) if not isinstance(cb, Callback)]
