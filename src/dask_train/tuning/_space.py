"""Search spaces: ranges and choices of hyper-parameters, and their optuna distributions.

A space maps a parameter name to a :func:`loguniform`, :func:`uniform` or :func:`intuniform` range,
a list of choices, or a single fixed value. Choices that optuna cannot store (classes, functions,
tuples) are sampled by position and mapped back, so ``{"optimizer": [torch.optim.SGD, "adam"]}``
works. Pure: nothing here imports optuna until :func:`distributions` is called.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dask_train.errors import InvalidInput

_STORABLE = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class Range:
    """A numeric range to sample from: ``kind`` is ``"float"`` or ``"int"``; ``log`` samples
    uniformly in log space; ``step`` spaces the values (None: continuous / every integer)."""

    low: float
    high: float
    kind: str = "float"
    log: bool = False
    step: float | None = None

    def problems(self, name: str) -> list[str]:
        """What is wrong with this range as the parameter ``name``."""
        out = []
        real = all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
                   for v in (self.low, self.high))
        if not real:
            return [f"space[{name!r}]={self!r} is invalid: low and high must be finite numbers."]
        if self.kind == "int" and not all(float(v).is_integer() for v in (self.low, self.high)):
            out.append(f"space[{name!r}]={self!r} is invalid: intuniform takes integer bounds.")
        if not self.low < self.high:
            out.append(f"space[{name!r}]={self!r} is invalid: use low < high.")
        if self.log and self.low <= 0:
            out.append(f"space[{name!r}]={self!r} is invalid: a log range needs low > 0.")
        if self.step is not None and (self.log or not self.step > 0):
            out.append(f"space[{name!r}]={self!r} is invalid: step must be > 0 and cannot be "
                       "combined with log=True.")
        return out

    def __repr__(self) -> str:
        fn = {"float": "loguniform" if self.log else "uniform",
              "int": "intuniform"}[self.kind]
        extra = ", log=True" if self.log and self.kind == "int" else ""
        extra += f", step={self.step}" if self.step is not None else ""
        return f"{fn}({self.low:g}, {self.high:g}{extra})"


def loguniform(low: float, high: float) -> Range:
    """Floats between ``low`` and ``high`` (both > 0), uniform in log space: learning rates,
    regularisation strengths.

    Examples
    --------
    >>> loguniform(1e-4, 1e-1)
    loguniform(0.0001, 0.1)
    """
    return Range(low, high, "float", log=True)


def uniform(low: float, high: float, *, step: float | None = None) -> Range:
    """Floats between ``low`` and ``high``, uniform (on a grid of ``step`` if given).

    Examples
    --------
    >>> uniform(0.0, 0.5)
    uniform(0, 0.5)
    """
    return Range(low, high, "float", step=step)


def intuniform(low: int, high: int, *, log: bool = False, step: int = 1) -> Range:
    """Integers from ``low`` to ``high`` inclusive (uniform in log space with ``log=True``).

    Examples
    --------
    >>> intuniform(32, 512, log=True)
    intuniform(32, 512, log=True)
    """
    return Range(low, high, "int", log=log, step=None if step == 1 else step)


@dataclass(frozen=True)
class Space:
    """A validated search space: each name -> a :class:`Range`, a list of choices, or a fixed value.

    Examples
    --------
    >>> space = Space.parse({"lr": loguniform(1e-4, 1e-1), "batch_size": [64, 128], "epochs": 2})
    >>> space.names, space.fixed
    (['batch_size', 'lr'], {'epochs': 2})
    """

    ranges: Mapping[str, Range]
    choices: Mapping[str, tuple[Any, ...]]
    fixed: Mapping[str, Any]

    @classmethod
    def parse(cls, space: Any) -> Space:
        """Check ``space`` and split it; :class:`InvalidInput` lists every problem."""
        if not isinstance(space, Mapping) or not space:
            raise InvalidInput([f"space={space!r} is invalid: pass a dict of parameter name -> "
                                "dt.loguniform(...), dt.uniform(...), dt.intuniform(...) or a "
                                "list of choices."])
        problems: list[str] = []
        ranges: dict[str, Range] = {}
        choices: dict[str, tuple[Any, ...]] = {}
        fixed: dict[str, Any] = {}
        for name, value in space.items():
            if not isinstance(name, str) or not name:
                problems.append(f"space key {name!r} is invalid: use parameter names (str).")
            elif isinstance(value, Range):
                problems += value.problems(name)
                ranges[name] = value
            elif isinstance(value, (list, tuple)):
                if not value:
                    problems.append(f"space[{name!r}]=[] is invalid: list at least one choice.")
                choices[name] = tuple(value)
            else:
                fixed[name] = value
        if problems:
            raise InvalidInput(problems)
        return cls(ranges, choices, fixed)

    @property
    def names(self) -> list[str]:
        """The searched (not fixed) parameter names, sorted."""
        return sorted([*self.ranges, *self.choices])

    @property
    def all_names(self) -> list[str]:
        """Every parameter name, fixed ones included."""
        return sorted([*self.ranges, *self.choices, *self.fixed])

    def first(self) -> dict[str, Any]:
        """One point of the space: each range's low end, each list's first choice, the fixed
        values (what is checked before any work)."""
        values = dict(self.fixed)
        for name, r in self.ranges.items():
            values[name] = int(r.low) if r.kind == "int" else float(r.low)
        for name, options in self.choices.items():
            values[name] = options[0]
        return values

    def distributions(self) -> dict[str, Any]:
        """optuna distributions for ``study.ask(fixed_distributions=...)``."""
        from optuna.distributions import (
            CategoricalDistribution,
            FloatDistribution,
            IntDistribution,
        )

        out: dict[str, Any] = {}
        for name, r in self.ranges.items():
            if r.kind == "int":
                out[name] = IntDistribution(int(r.low), int(r.high), log=r.log,
                                            step=int(r.step or 1))
            else:
                out[name] = FloatDistribution(float(r.low), float(r.high), log=r.log, step=r.step)
        for name, options in self.choices.items():
            storable = all(isinstance(o, _STORABLE) for o in options)
            out[name] = CategoricalDistribution(options if storable else tuple(range(len(options))))
        return out

    def values(self, sampled: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters of one trial: optuna's sampled values (choices that optuna could not
        store mapped back from their position) plus the fixed ones."""
        out = dict(self.fixed)
        for name, value in sampled.items():
            options = self.choices.get(name)
            if options is not None and not all(isinstance(o, _STORABLE) for o in options):
                value = options[int(value)]
            out[name] = value
        return out


def describe(params: Mapping[str, Any]) -> dict[str, Any]:
    """Parameters as plain values for a table: classes and functions by name."""
    out: dict[str, Any] = {}
    for name, value in params.items():
        if isinstance(value, _STORABLE):
            out[name] = value
        else:
            out[name] = getattr(value, "__name__", None) or repr(value)
    return out


def check_names(space: Space, known: Sequence[str], *, owner: str) -> list[str]:
    """A problem per space name that ``owner`` does not take."""
    return [f"space[{name!r}] is not a parameter of {owner}: use one of {sorted(known)}."
            for name in space.all_names if name not in known]
