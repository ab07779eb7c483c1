"""The throughput grid: workers x parameter servers x model size [x link rate], measured and modelled.

Each point is one real ``Trainer(strategy="async-ps")`` job without a scorer, stopped after
``seconds``; its rate is the sum over trainers of samples over the time each trainer ran (from
its first parameters to its exit), so start-up is left out. For each model (and link rate) the
per-step costs are probed once on the cluster (``engines.measure.ps_costs``) and the cost model is
calibrated on a few of the measured points; every row then carries the model's prediction.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from distributed import Client

from dask_train.errors import InvalidInput
from dask_train.policy._cost import CostModel, Measured, calibrate
from dask_train.runtime._calls import live_workers

#: The factors calibrate() fits from the measured points (the rest are probed), as many as there
#: are points: the fixed cost of an exchange (what a probe on a busy cluster gets least right), the
#: share of the link rate a transfer gets, and how much a trainer's replies overlap its pushes
#: (only seen with several server counts).
FIT = ("message_s", "link_efficiency", "overlap")


@dataclass(frozen=True)
class Grid:
    """What to measure.

    Parameters
    ----------
    workers, ps : sequence of int
        Trainer and server counts; every pair is measured.
    models : sequence of tuple of int
        MLP layer widths, input first (``(64, 1024, 1024, 10)``).
    link_rates : sequence of float or None
        Mbit/s of every host's link (network-namespace clusters only); ``(None,)``: as it is.
    seconds : float
        Length of each measured job.
    batch_size, prefetch : int
        As the Trainer takes them.
    n_samples : int
        Rows of augmented digits to train on (generated on the workers once).
    calibrate_on : sequence of (workers, ps)
        Points the cost model is calibrated on; default: the fewest workers with the fewest
        servers, the most workers with the fewest servers and the most workers with the most.
    """

    workers: Sequence[int] = (1, 2, 4)
    ps: Sequence[int] = (1, 2, 4)
    models: Sequence[tuple[int, ...]] = ((64, 256, 10),)
    link_rates: Sequence[float | None] = (None,)
    seconds: float = 8.0
    batch_size: int = 128
    prefetch: int = 1
    n_samples: int = 200_000
    calibrate_on: Sequence[tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        problems = []
        for name in ("workers", "ps"):
            values = list(getattr(self, name))
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                 for v in values):
                problems.append(f"{name}={values!r} is invalid: use integers >= 1.")
        for widths in self.models:
            if len(widths) < 2 or any(not isinstance(w, int) or w < 1 for w in widths):
                problems.append(f"model {widths!r} is invalid: give layer widths such as 64-256-10.")
            elif widths[0] != 64 or widths[-1] != 10:
                problems.append(f"model {'-'.join(map(str, widths))} is invalid: the digits "
                                "have 64 inputs and 10 classes, e.g. 64-256-10.")
        problems += [f"link rate {r!r} is invalid: use Mbit/s > 0." for r in self.link_rates
                     if r is not None and not r > 0]
        if not self.seconds > 0:
            problems.append(f"seconds={self.seconds!r} is invalid: use a number > 0.")
        if problems:
            raise InvalidInput(problems)

    @property
    def size(self) -> int:
        return len(self.workers) * len(self.ps) * len(self.models) * len(self.link_rates)

    def calibration_points(self) -> list[tuple[int, int]]:
        if self.calibrate_on is not None:
            return [tuple(p) for p in self.calibrate_on]  # type: ignore[misc]
        low, high, few, many = min(self.workers), max(self.workers), min(self.ps), max(self.ps)
        return sorted({(low, few), (high, few), (high, many)})


@dataclass
class GroupResult:
    """One model at one link rate: the probed and the calibrated cost model, and its rows."""

    model: tuple[int, ...]
    link_mbit: float | None
    probed: CostModel
    calibrated: CostModel | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)


def parse_widths(text: str) -> tuple[int, ...]:
    """``"64-256-10"`` -> ``(64, 256, 10)``."""
    try:
        return tuple(int(part) for part in text.split("-"))
    except ValueError:
        raise InvalidInput([f"model {text!r} is invalid: give layer widths such as 64-256-10."]) \
            from None


def build_mlp(widths: Sequence[int], *, seed: int = 0) -> torch.nn.Module:
    """A ReLU MLP with these layer widths and seeded weights."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for d_in, d_out in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(d_in, d_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def n_params(widths: Sequence[int]) -> int:
    """Parameters of ``build_mlp(widths)``: weights and biases."""
    return sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))


def measure(client: Client, X: Any, y: Any, *, widths: Sequence[int], workers: int, ps: int,
            steps: int, batch_size: int, prefetch: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Train one async-ps job for ``steps`` server updates; return its steady rates.

    A step count, not a time limit: the job's clock starts before its roles do, and starting
    them can take longer than a short measurement (a loaded machine, slow links).
    """
    from dask_train.api import Trainer
    from dask_train.policy.stop import StopAfter, StopAtStep

    trainer = Trainer(build_mlp(widths), loss="cross_entropy", optimizer="adam", lr=1e-3,
                      strategy="async-ps", ps=ps, workers=workers, scorer=0,
                      batch_size=batch_size, epochs=10_000, prefetch=prefetch,
                      stop=[StopAtStep(steps), StopAfter(seconds=timeout_s)],
                      progress=False, timeout=120, client=client)
    result = trainer.fit(X, y)
    ran = [t for t in result.trainers if t.get("busy_s", 0) > 0 and t.get("steps", 0) > 0]
    busy = sum(t["busy_s"] for t in ran)
    return {
        "samples_per_s": sum(t["samples"] / t["busy_s"] for t in ran),
        "steps_per_s": sum(t["steps"] / t["busy_s"] for t in ran),
        "ps_wait": sum(t["ps_wait_s"] for t in ran) / busy if busy else math.nan,
        "seconds": max((t["busy_s"] for t in ran), default=math.nan), "steps": result.steps,
    }


def run_grid(
    client: Client, grid: Grid, *, set_link: Callable[[float | None], None] | None = None,
    progress: bool = True,
) -> list[GroupResult]:
    """Measure every point of ``grid`` on ``client``'s cluster; return one group per model and link.

    ``set_link(mbit)`` shapes every host's link before its group (network-namespace clusters).
    """
    X, y, xb, yb = _data(client, grid)
    groups: list[GroupResult] = []
    with _bar(grid.size, progress) as bar:
        for link in grid.link_rates:
            if set_link is not None:
                set_link(link)
            for widths in grid.models:
                group = GroupResult(model=tuple(widths), link_mbit=link,
                                    probed=_probe(client, widths, xb, yb, grid))
                for w in grid.workers:
                    for p in grid.ps:
                        bar.set_postfix_str(f"{'-'.join(map(str, widths))} w={w} ps={p}"
                                            + (f" {link:g} Mbit/s" if link else ""))
                        started = time.time()
                        got = measure(client, X, y, widths=widths, workers=w, ps=p,
                                      steps=_steps_for(group, w, p, grid.seconds),
                                      batch_size=grid.batch_size, prefetch=grid.prefetch)
                        group.rows.append({
                            "model": "-".join(map(str, widths)), "params": n_params(widths),
                            "link_mbit": link, "workers": w, "ps": p, **got,
                            "wall_s": time.time() - started,
                        })
                        bar.update(1)
                _predict(group, grid)
                groups.append(group)
    return groups


def _data(client: Client, grid: Grid) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """The digits, persisted on the workers once for the whole grid, and one batch of them."""
    from dask_train.datasets import digits

    client.run(_import_torch)  # every worker once, before anything is timed (2 s or more each)
    n_workers = max(len(live_workers(client)), 1)
    X, y = digits(n_samples=grid.n_samples, seed=0,
                              chunks=max(1000, grid.n_samples // (4 * n_workers)))
    X, y = client.persist([X, y])
    xb, yb = client.compute([X[: grid.batch_size], y[: grid.batch_size]], sync=True)
    return X, y, np.asarray(xb), np.asarray(yb)


def _import_torch() -> None:
    import torch  # noqa: F401


def _steps_for(group: GroupResult, workers: int, ps: int, seconds: float) -> int:
    """Server updates that take about ``seconds`` at the expected rate: the probed model's
    prediction, scaled by how far off it was on the points already measured in this group."""
    predicted = group.probed.predict(workers=workers, ps=ps).steps_per_s
    ratios = [r["steps_per_s"] / group.probed.predict(workers=r["workers"], ps=r["ps"]).steps_per_s
              for r in group.rows if r["steps_per_s"] > 0]
    factor = float(np.median(ratios)) if ratios else 1.0
    return int(min(max(predicted * factor * seconds, 10), 10**7))


def _probe(client: Client, widths: Sequence[int], xb: np.ndarray, yb: np.ndarray,
           grid: Grid) -> CostModel:
    from dask_train.engines.measure.ps_costs import probe_costs
    from dask_train.policy._settings import OptimizerSettings

    return probe_costs(client, build_mlp(widths), xb, yb, loss="cross_entropy",
                       optim=OptimizerSettings("adam", 1e-3), prefetch=grid.prefetch)


def _predict(group: GroupResult, grid: Grid) -> None:
    """Calibrate the group's cost model on the chosen points; add predictions to every row."""
    by_point = {(r["workers"], r["ps"]): r for r in group.rows if r["steps_per_s"] > 0}
    points = [Measured(w, p, by_point[(w, p)]["steps_per_s"])
              for w, p in grid.calibration_points() if (w, p) in by_point]
    model = group.probed
    fit = [f for f in FIT if f != "overlap" or len({p.ps for p in points}) > 1][: len(points)]
    if points:
        model = calibrate(model, points, fit=fit)
        group.calibrated = model
    for row in group.rows:
        predicted = model.predict(workers=row["workers"], ps=row["ps"])
        row["predicted_samples_per_s"] = predicted.steps_per_s * grid.batch_size
        row["error"] = predicted.steps_per_s / row["steps_per_s"] - 1 if row["steps_per_s"] else math.nan
        row["calibration_point"] = (row["workers"], row["ps"]) in {(p.workers, p.ps) for p in points}
        row["bottleneck"] = predicted.bottleneck


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


@contextlib.contextmanager
def _bar(total: int, enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield _NoBar()
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, desc="dask-train bench", unit="point", dynamic_ncols=True) as bar:
        yield bar
