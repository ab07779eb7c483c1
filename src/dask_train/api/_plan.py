"""One fit's plan: its settings, the model it trains, and the roles it runs, built once per fit.

``Trainer.fit`` builds a :class:`FitPlan` from the Trainer's parameters and hands it to every
builder (the strategy's measurement, the job spec, the roles, the result): none of them reads
the Trainer, and a second fit builds its own plan. Only ``choice`` is added after the plan is
first built, once the strategy is measured or taken as given (``dataclasses.replace``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dask_train.api._settings import Settings


@dataclass(frozen=True)
class Choice:
    """How one fit runs: the engine's strategy, its trainers (ranks) and servers, and what
    ``FitResult.plan`` reports of the choice."""

    strategy: str
    workers: int
    ps: int
    record: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FitPlan:
    """Everything one fit is built from.

    Attributes
    ----------
    settings : Settings
        The Trainer's parameters by concern (``module`` is ``model``).
    params : mapping
        The flat parameters as given (what callbacks record of them).
    model : object
        The model this fit trains: the module, or what its factory built.
    factory : callable or None
        The function that built ``model``, when the Trainer was given one: the roles build
        their own with it (a model that cannot be pickled).
    choice : Choice or None
        The strategy, trainers and servers, once chosen (None until then: the settings' own).
    clock : dict
        Seconds of the fit's phases before the controller's: ``fit`` (its start), ``connect``,
        ``persist``. The one mutable part: each phase adds to it as it ends.
    """

    settings: Settings
    params: Mapping[str, Any]
    model: Any
    factory: Any = None
    choice: Choice | None = None
    clock: dict[str, float] = field(
        default_factory=lambda: {"fit": time.time(), "connect": 0.0, "persist": 0.0})

    @property
    def strategy(self) -> str:
        """The strategy this fit runs: ``strategy``, or the one ``"auto"`` chose."""
        return self.choice.strategy if self.choice is not None else str(self.settings.strategy)

    @property
    def engine(self) -> str:
        """The registry's name of the engine this fit runs (``engines._registry``): its
        strategy's, or ``"array"``, numpy's one engine, for an ``ArrayModel`` (whose
        ``strategy="sync"`` names what it does, not which engine does it)."""
        from dask_train.models._array import ArrayModel

        return "array" if isinstance(self.model, ArrayModel) else self.strategy

    @property
    def trainers(self) -> int:
        """The trainers (ranks) this fit runs: ``workers``, or those chosen on the cluster
        (by ``"auto"``, or within ``workers=(least, most)``; the least before that)."""
        return self.choice.workers if self.choice is not None else \
            self.settings.cluster.bounds(0)[0]

    @property
    def servers(self) -> int:
        """Parameter servers: with ``ps="auto"`` or ``strategy="auto"``, the count chosen."""
        if self.choice is not None:
            return self.choice.ps
        ps = self.settings.ps
        return ps if isinstance(ps, int) else 1

    @classmethod
    def of(cls, params: Mapping[str, Any], *, model: Any, factory: Any = None) -> FitPlan:
        """The plan of a fit of these flat parameters, training ``model`` (built by
        ``factory``, if one was given)."""
        return cls(settings=Settings.of(params, module=model), params=dict(params), model=model,
                   factory=factory)

    def per_trainer_batch(self) -> int:
        """Rows of each trainer's batch for the trainers this fit runs."""
        return self.settings.data.per_trainer_batch(self.trainers)

    def tracked_params(self) -> dict[str, Any]:
        """The hyper-parameters a callback records (``on_fit_start``'s ``info["params"]``)."""
        return {k: v for k, v in self.params.items() if k not in ("callbacks", "client")}

    def chose(self, choice: Choice) -> FitPlan:
        """This plan with its strategy chosen."""
        return dataclasses.replace(self, choice=choice)

    def took(self, phase: str, since: float) -> None:
        """Add the seconds since ``since`` to ``phase`` of the clock."""
        self.clock[phase] = self.clock.get(phase, 0.0) + time.time() - since
