"""The controller's explicit state: which phase a job is in, and what outlives its generations.

Every change of phase happens in :meth:`JobState.enter`, which refuses the transitions the
controller never makes, so a wrong one is a loud bug rather than a silent flag mix-up.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class Phase(enum.Enum):
    """Where a job is."""

    STARTING = "starting"  # placing roles, starting servers and trainers of a generation
    RUNNING = "running"  # training: events in, grants out, stop conditions checked
    CHECKPOINTING = "checkpointing"  # trainers asked to pause; the checkpoint is written once all have
    RESTARTING = "restarting"  # a lost role: this generation ends, the next starts from a checkpoint
    FINISHING = "finishing"  # a stop fired: roles stop, final score, final parameters and checkpoint
    FINISHED = "finished"
    ERRORED = "errored"


_NEXT: dict[Phase, frozenset[Phase]] = {
    # A role lost while a generation starts restarts it, as one lost while it runs does.
    Phase.STARTING: frozenset({Phase.RUNNING, Phase.RESTARTING, Phase.ERRORED}),
    Phase.RUNNING: frozenset({Phase.CHECKPOINTING, Phase.RESTARTING, Phase.FINISHING,
                              Phase.ERRORED}),
    Phase.CHECKPOINTING: frozenset({Phase.RUNNING, Phase.RESTARTING, Phase.FINISHING,
                                    Phase.ERRORED}),
    Phase.RESTARTING: frozenset({Phase.STARTING, Phase.ERRORED}),
    # A parameter server or a rank lost while the roles stop: the job goes on in a new one.
    Phase.FINISHING: frozenset({Phase.FINISHED, Phase.RESTARTING, Phase.ERRORED}),
    Phase.FINISHED: frozenset(),
    Phase.ERRORED: frozenset(),
}


@dataclass
class JobLog:
    """What outlives a generation: history, failures, checkpoints, time already trained."""

    records: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    # Workers that left with notice and whose roles were handed over (not failures).
    departures: list[dict[str, Any]] = field(default_factory=list)
    # Workers that joined and were given roles at a regroup (sync and dt.run jobs).
    arrivals: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    nonfinite: list[dict[str, Any]] = field(default_factory=list)
    elapsed_before: float = 0.0  # seconds trained before this fit (a resumed checkpoint's)
    started: float = field(default_factory=time.time)
    generations: int = 0
    # When the first generation's roles were up, its first step taken, and a stop decided
    # (wall-clock seconds; None until it happens): FitResult.timings.
    roles_up_at: float | None = None
    first_step_at: float | None = None
    stop_at: float | None = None

    def elapsed(self, now: float | None = None) -> float:
        """Seconds of training in this job, resumed time included."""
        return (now or time.time()) - self.started + self.elapsed_before


@dataclass
class CheckpointTimes:
    """When a store of the job's state last wrote, and at which step: what its schedule reads.
    The job's checkpoints keep theirs in :class:`JobState`; its in-memory copies, kept beside
    ``checkpoint=`` until the first checkpoint is written, keep their own here, so that a copy
    every few seconds does not put the checkpoints' schedule off."""

    last_checkpoint_time: float = field(default_factory=time.time)
    last_checkpoint_step: int = 0


@dataclass
class JobState:
    """The controller's whole mutable state, in one place.

    Attributes
    ----------
    phase : Phase
    generation : int
        Generations started so far minus one (0 for the first).
    stopped_by : str
        Why the job is stopping ("" while it runs).
    stop_step : int or None
        The step of the score that stopped the job: its parameters are the result.
    nan_stop : bool
        A non-finite loss or score stopped the job: no checkpoint is written after it.
    callback_withdrawn : bool
        A callback's stop was withdrawn (:meth:`withdraw_stop`): it is made again as soon as
        the next generation runs.
    pause_id : int
        The checkpoint pause in progress (0 when none).
    pause_started : float
    last_checkpoint_time, last_checkpoint_step : float, int
    epochs_seen : int
        Epochs whose ``on_epoch_end`` has been called.
    """

    phase: Phase = Phase.STARTING
    generation: int = 0
    stopped_by: str = ""
    stop_step: int | None = None
    nan_stop: bool = False
    callback_withdrawn: bool = False
    pause_id: int = 0
    next_pause_id: int = 1
    pause_started: float = 0.0
    last_checkpoint_time: float = field(default_factory=time.time)
    last_checkpoint_step: int = 0
    epochs_seen: int = 0
    history: list[Phase] = field(default_factory=list)

    def enter(self, phase: Phase) -> None:
        """Move to ``phase``; a transition the controller never makes raises ``RuntimeError``."""
        if phase not in _NEXT[self.phase]:
            raise RuntimeError(f"job state: {self.phase.value} -> {phase.value} is not a transition")
        self.history.append(self.phase)
        self.phase = phase

    def withdraw_stop(self) -> str:
        """Forget a stop decided on what a generation did that is now lost (a role died in the
        same pass): the next generation trains on from the checkpoint, and the stop conditions
        decide again on what it does. Returns the reason withdrawn ("" when none).

        A callback that returned True is not asked again: its stop is made again as soon as the
        next generation runs (:attr:`callback_withdrawn`; a one-shot callback's stop, lost with
        a role, once left the job training to its ``epochs``)."""
        reason, self.stopped_by, self.stop_step = self.stopped_by, "", None
        self.callback_withdrawn = self.callback_withdrawn or reason == "callback"
        return reason

    def stop(self, reason: str) -> bool:
        """Record why the job stops (the first reason wins); True when this call set it."""
        if self.stopped_by:
            return False
        self.stopped_by = reason
        return True
