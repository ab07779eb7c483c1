"""The engine protocol: what the one controller needs from any way of training.

An engine is one generation of a job on the cluster. The controller
(:mod:`dask_train.controller`) owns everything that is the same for every engine: the score
history, stop conditions and callbacks, non-finite handling, when to checkpoint and the manifest,
the failure policy and the generations. An engine owns where its roles run and how data and
gradients move. It talks back through one stream of typed events (``emit``), each a record of
:mod:`dask_train.engines._events`:

* :class:`~._events.Started`: start-up ended, the first step was applied (``FitResult.timings``);
* :class:`~._events.Score`: a validation score (its metrics, and which are not finite);
* :class:`~._events.NonFinite`: a non-finite training loss;
* :class:`~._events.Epochs`: epochs fully consumed so far (for ``on_epoch_end``);
* :class:`~._events.Progress`: the engine's step count moved (checkpoint scheduling);
* :class:`~._events.Stats`: a trainer's or server's last second (for ``Callback.on_stats``).

The trainers' own bookkeeping events (:class:`~._events.Block`, :class:`~._events.Paused`,
:class:`~._events.Exit`) stay inside the role engines. An engine whose ranks report
(``dt.run``'s, :class:`~._events.ReportReady`) is a :class:`Reporting` too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dask_train.engines._events import Event
from dask_train.policy._failure import Failure
from dask_train.policy._placement import Roles
from dask_train.runtime._cluster_view import ClusterView

Emit = Callable[[Event], None]


@dataclass
class Snapshot:
    """The engine's state at a consistent point, every trainer paused: what a manifest records.

    ``ledger`` is the data position (a JSON-able ledger state), ``rng`` the RNG state per trainer.
    """

    step: int
    ledger: dict[str, Any]
    rng: dict[str, str] = field(default_factory=dict)


@dataclass
class Ending:
    """What an engine hands back when it stops.

    ``final`` is the scorer's last answer (``{"record", "params"}``: the scored parameters when a
    score stopped the job, else the final parameters' :class:`~._events.Score` and
    ``params=None``), or None.
    """

    params: Any
    steps: int
    samples: int
    trainers: list[dict[str, Any]]
    final: dict[str, Any] | None = None
    rng: dict[str, str] = field(default_factory=dict)
    #: The model's trained buffers (a float64 vector, see ``models._buffers``), None without any.
    buffers: Any = None


class Engine(ABC):
    """One generation of a job: start, feed, pause and snapshot, stop, pull, close.

    Every ``async`` method runs on the client's event loop and bounds each wait by the job's
    timeout. Methods not marked abstract have the behaviour of an engine without that feature.
    What only some engines can do is what they are, not a flag: :class:`Elastic`,
    :class:`Survivable`, :class:`Regrouping`, :class:`Reporting` beside this class.
    """

    #: The failure policy's name of this engine's kind ("async-ps", "sync" or "run").
    strategy: str = "sync"
    roles: Roles

    @abstractmethod
    async def start(self, emit: Emit) -> None:
        """Place and start every role; events go to ``emit`` from now on."""

    @abstractmethod
    async def tick(self, now: float) -> str:
        """Periodic work (about 5 times a second); the reason the engine ended on its own, or ""."""

    @abstractmethod
    def epochs_completed(self) -> int:
        """Epochs whose every row has been consumed."""

    @abstractmethod
    def reported_step(self) -> int:
        """The step count as best known without asking the workers."""

    @abstractmethod
    def ledger_state(self) -> dict[str, Any]:
        """The data position as JSON-able state (a manifest's ``ledger``), every trainer stopped."""

    async def exact_step(self) -> int:
        """The step count, exact while every trainer is paused."""
        return self.reported_step()

    @abstractmethod
    def ledger_records(self) -> list[dict[str, Any]]:
        """One row per (epoch, block) handed out, for ``FitResult.ledger``."""

    # -- failures ---------------------------------------------------------------------------------
    async def failures(self, view: ClusterView) -> list[Failure]:
        """Roles whose worker ``view`` (the controller's listing of this pass) no longer lists,
        or that raised."""
        return []

    def live_trainers(self) -> int:
        """Trainers still taking part."""
        return len(self.roles.get("trainer", []))

    async def replace_scorer(self, alive: Mapping[str, int]) -> None:
        """Start the scorer again on a live worker."""
        raise NotImplementedError(f"{type(self).__name__} has no scorer to replace")

    def leaving(self) -> set[str]:
        """Workers of this generation's roles that announced they are leaving with notice, held
        until the controller has handed their state over (an engine that cannot hand over
        returns none: their departure is then a loss)."""
        return set()

    def left(self, workers: set[str]) -> None:
        """Forget that ``workers`` were leaving: their hand-over failed, they are lost."""

    # -- checkpoints ------------------------------------------------------------------------------
    @abstractmethod
    def running(self) -> bool:
        """True while some trainer can still take part in a checkpoint pause."""

    @abstractmethod
    async def pause(self, pause_id: int) -> None:
        """Ask every trainer to pause at its next consistent point."""

    @abstractmethod
    def paused(self, pause_id: int) -> Snapshot | None:
        """The snapshot once every running trainer has paused for ``pause_id``, else None."""

    @abstractmethod
    async def resume(self, pause_id: int) -> None:
        """Let the paused trainers go on."""

    @abstractmethod
    async def save(self, *, directory: str, paths: Callable[[int], str],
                   metadata: Mapping[str, str]) -> list[dict[str, Any]]:
        """Write the parameters and optimizer state (paused or stopped), one record per file:
        ``{"index", "start", "stop", "version", "samples", "finite"}``."""

    # -- ending -----------------------------------------------------------------------------------
    @abstractmethod
    async def stop(self, *, keep_step: int | None) -> Ending:
        """Stop every role and return the final parameters; ``keep_step`` is the step whose
        scored parameters the result should hold (a score stopped the job), if any."""

    @abstractmethod
    async def close(self) -> None:
        """Release everything the generation holds on the cluster (never raises)."""


class Elastic(ABC):
    """What an engine whose trainers come and go within a generation answers beside
    :class:`Engine` (async-ps: the servers hold the state, each trainer reads its own blocks):
    a lost trainer retired, a joined worker given a trainer, no new generation for either. Its
    trainers are independent: the failure policy goes on without a lost one."""

    @abstractmethod
    async def retire_trainer(self, index: int) -> None:
        """Go on without trainer ``index``; its unconsumed rows go to the survivors."""

    @abstractmethod
    async def adopt_workers(self, alive: Mapping[str, int]) -> None:
        """Give workers that joined a role, where the engine can use them."""


class Survivable(ABC):
    """What an engine whose surviving trainers hold the state to go on from after a trainer is
    killed answers beside :class:`Engine` (sync ranks, ``dt.run``'s: every rank holds the
    parameters of the last step all applied). Another engine's job restarts from its stored
    checkpoint."""

    @abstractmethod
    async def survivors(self, lost: set[str]) -> Snapshot | None:
        """After ``lost`` workers were killed: the newest consistent state the surviving
        trainers hold in memory, as a snapshot that :meth:`Engine.save` then writes from them
        (its step, the data position of every trainer at it), or None when none holds one."""


class Regrouping:
    """An engine whose group of trainers is fixed for a generation (sync ranks, ``dt.run``'s: a
    process group's size is fixed): workers that joined are taken in by a new generation, which
    the controller starts through a hand-over when the job's placement would grow onto them.
    A mark only: such an engine answers nothing beyond :class:`Engine` (an :class:`Elastic`
    engine adopts joined workers instead)."""


class Reporting(ABC):
    """What an engine whose ranks report (``dt.run``'s, :class:`~._events.ReportReady`) answers
    beside :class:`Engine`; the controller's reports (``controller._reports``) ask an engine
    that is one.

    Its ranks, not a schedule, say when to checkpoint (at a ``ctx.report(checkpoint=...)``):
    the controller never pauses it on a schedule and writes no final checkpoint of its own.
    And its ranks' final state is its result: after a score stopped the job, the scores of
    later steps still queued are recorded (another engine's result holds the parameters that
    score was taken of, ``stop(keep_step=...)``, and those later scores are left out)."""

    @abstractmethod
    def report_copy(self) -> tuple[Snapshot, int] | None:
        """The newest report's state when one worker alone holds it (a ``dt.run`` job whose
        state only rank 0 passes), as its snapshot and the step its holder must still be at;
        the controller keeps a copy on another worker, written while the ranks go on. None
        when the state is held twice already or kept otherwise."""
