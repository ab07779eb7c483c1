"""What a restart starts from: the newest of the states a new generation could go on from.

After a loss that needs a new generation, the controller has up to three states in hand: the
one the surviving ranks hold (sync), the newest in the job's store (``checkpoint=``'s, or the
in-memory copies'), and the one the lost generation started from. :func:`restart_store` says
which store to read, :func:`choose_restart` which state to start from, how the restart is
recorded (``result.failures``' ``"from"``) and how many samples are trained again. The
controller reads the stores and carries the choice out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Store(enum.Enum):
    """A job's store of checkpoints; the value is how a restart from it is recorded."""

    CHECKPOINTS = "checkpoint"  # checkpoint='s
    COPIES = "copy"  # the in-memory copies (policy._copies)


class Source(enum.Enum):
    """Which state a new generation starts from."""

    SURVIVORS = "survivors"  # the state the surviving ranks hold, written for the restart
    STORED = "stored"  # the store's newest (Store says which store)
    GENERATION = "generation"  # the state the lost generation started from
    INITIAL = "start"  # the initial parameters


@dataclass(frozen=True)
class Candidate:
    """A state a restart could start from: its step and the samples its ledger had applied."""

    step: int
    samples: int = 0


@dataclass(frozen=True)
class RestartChoice:
    """What a restart starts from.

    Attributes
    ----------
    source : Source
    label : str
        How the restart's failure record names it (``"from"``): ``"survivors"``, ``"start"``,
        ``"generation"``, ``"checkpoint"`` or ``"copy"``.
    redone : int
        Samples applied since that state, to be trained again.
    """

    source: Source
    label: str
    redone: int


def restart_store(*, copied: bool, checkpointed: bool, has_checkpoint_store: bool) -> Store:
    """The store whose newest state a restart reads: the in-memory copies while they hold one
    (``copied``) and ``checkpoint=``'s store holds none of this job (``checkpointed``), else
    ``checkpoint=``'s when the job has one, else the copies.

    Examples
    --------
    >>> restart_store(copied=True, checkpointed=False, has_checkpoint_store=True)
    <Store.COPIES: 'copy'>
    >>> restart_store(copied=True, checkpointed=True, has_checkpoint_store=True)
    <Store.CHECKPOINTS: 'checkpoint'>
    """
    if copied and not checkpointed:
        return Store.COPIES
    return Store.CHECKPOINTS if has_checkpoint_store else Store.COPIES


def choose_restart(*, survivors: Candidate | None, stored: Candidate | None,
                   started: Candidate | None, store: Store, applied: int) -> RestartChoice:
    """The state a new generation starts from, first that holds: the survivors' (they hold the
    newest), the store's newest unless the state the generation started from is newer (a
    hand-over's, written to a store of its own, then its next generation's worker lost too),
    that state, else the initial parameters.

    Parameters
    ----------
    survivors, stored, started : Candidate or None
        The surviving ranks' state, the store's newest, the state the lost generation started
        from; None for one there is not.
    store : Store
        The store ``stored`` was read from (:func:`restart_store`).
    applied : int
        Samples the lost generation's ledger had applied (those of the state it started from
        included).

    Returns
    -------
    RestartChoice
        ``redone`` is what the ledger had applied beyond the chosen state's samples (once: the
        next generation's ledger starts from that state's, or from nothing).

    Examples
    --------
    >>> choose_restart(survivors=None, stored=Candidate(step=40, samples=1280),
    ...                started=Candidate(step=10, samples=320), store=Store.COPIES, applied=2000)
    RestartChoice(source=<Source.STORED: 'stored'>, label='copy', redone=720)
    """
    chosen: Candidate | None
    if survivors is not None:
        source, chosen, label = Source.SURVIVORS, survivors, Source.SURVIVORS.value
    elif stored is not None and (started is None or stored.step >= started.step):
        source, chosen, label = Source.STORED, stored, store.value
    elif started is not None:
        source, chosen, label = Source.GENERATION, started, Source.GENERATION.value
    else:
        source, chosen, label = Source.INITIAL, None, Source.INITIAL.value
    kept = chosen.samples if chosen is not None else 0
    return RestartChoice(source=source, label=label, redone=max(0, applied - kept))
