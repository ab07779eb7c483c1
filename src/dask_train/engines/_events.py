"""The events of the engine protocol: one typed record per kind.

Worker-side roles publish events with ``worker.log_event``, which carries msgpack-able messages
only, so on the wire an event is a plain dict with a ``"kind"`` key (:meth:`message`). The
engine turns each message back into its record (:func:`from_message`) before anything reads it:
a misspelt field fails there, at once, instead of being a silent miss further on.

Who emits what:

============  ====================================  ==============================================
record        emitted by                            read by
============  ====================================  ==============================================
Started       the first trainer to apply a step     controller (``FitResult.timings``)
Block         a trainer, per block consumed         role engine (ledger, next grant)
Paused        a trainer, paused for a checkpoint    role engine (snapshot)
Exit          a trainer, as its last event          role engine (every report is in)
Score         the scorer (or the array engine)      controller (history, stop, callbacks)
NonFinite     a trainer whose loss is not finite    controller (``on_nan``)
Stats         a trainer or server, once a second    controller (``Callback.on_stats``), monitor
Epochs        the engine, as epochs complete        controller (``on_epoch_end``)
Progress      the engine, as its step count moves   controller (checkpoint scheduling)
Reported      a ``dt.run`` rank's ``ctx.report``    run engine (scores, snapshot)
ShareDone     a ``dt.run`` rank out of its epoch's    run engine (reports stop waiting for it)
              share
ReportReady   the run engine, once every rank       controller (checkpoint, then resume)
              reported
============  ====================================  ==============================================

Examples
--------
>>> event = Block(trainer=0, epoch=0, block=3, rows=500, done=True, steps=8)
>>> from_message(event.message()) == event
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class _Event:
    kind: ClassVar[str]

    def message(self) -> dict[str, Any]:
        """The msgpack-able dict that travels through ``worker.log_event``."""
        return {"kind": self.kind, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Started(_Event):
    """Start-up ended: the first step was applied (``trainer`` -1: the engine itself)."""

    kind: ClassVar[str] = "started"
    trainer: int


@dataclass(frozen=True)
class Block(_Event):
    """``rows`` rows of ``block`` in ``epoch`` were trained on; ``done``: the block is finished.
    ``steps``: the trainer's update count (its pushes, or the sync step) after them.
    ``starved``: the trainer waited for a block since its last report and its worker has room
    for one more (a streamed job's ``blocks_ahead="auto"`` then grants it one more)."""

    kind: ClassVar[str] = "block"
    trainer: int
    epoch: int
    block: int
    rows: int
    done: bool
    steps: int
    starved: bool = False


@dataclass(frozen=True)
class Paused(_Event):
    """The trainer paused for checkpoint ``id`` at ``position`` ([epoch, block, rows], or None
    between blocks) with its RNG state."""

    kind: ClassVar[str] = "paused"
    trainer: int
    id: int
    steps: int
    position: list[int] | None
    rng: str


@dataclass(frozen=True)
class Exit(_Event):
    """The trainer's last event: every report it sent before has arrived."""

    kind: ClassVar[str] = "exit"
    trainer: int
    steps: int


@dataclass(frozen=True)
class Score(_Event):
    """A validation score of the parameters at ``step``, after ``samples`` samples.

    ``metrics`` maps each score's name to its value; ``nonfinite`` names those that are not
    finite; ``wall`` is when it was taken (``time.time()``).
    """

    kind: ClassVar[str] = "score"
    step: int
    samples: int
    metrics: dict[str, float] = field(default_factory=dict)
    nonfinite: list[str] = field(default_factory=list)
    wall: float = 0.0
    #: The scorer's worker, as the scheduler stamps worker events (None: scored by the engine).
    worker: str | None = None

    def message(self) -> dict[str, Any]:
        """Flat, as the scores always travelled: the metrics beside the step."""
        return {"kind": self.kind, "step": self.step, "samples": self.samples, "wall": self.wall,
                "nonfinite": list(self.nonfinite), **self.metrics}


@dataclass(frozen=True)
class NonFinite(_Event):
    """A training loss that is not finite (``loss`` as text: NaN and inf survive msgpack so)."""

    kind: ClassVar[str] = "nan"
    trainer: int
    loss: str
    step: int
    epoch: int = -1
    block: int = -1
    #: How many non-finite losses this trainer has met so far (it reports the first few).
    count: int = 1


@dataclass(frozen=True)
class Stats(_Event):
    """What a role did in the last second (see :mod:`.harness.stats`): ``role`` ("trainer" or
    "ps"), its ``index``, and the figures it reports."""

    kind: ClassVar[str] = "stats"
    role: str
    index: int
    figures: dict[str, Any] = field(default_factory=dict)

    def message(self) -> dict[str, Any]:
        """Flat, as ``Callback.on_stats`` and the monitor read it."""
        return {"kind": self.kind, "role": self.role, "index": self.index, **self.figures}


@dataclass(frozen=True)
class Epochs(_Event):
    """Epochs fully consumed so far."""

    kind: ClassVar[str] = "epochs"
    completed: int


@dataclass(frozen=True)
class Progress(_Event):
    """The engine's step count moved."""

    kind: ClassVar[str] = "progress"
    step: int


@dataclass(frozen=True)
class Reported(_Event):
    """A ``dt.run`` rank called ``ctx.report`` for the ``id``-th time and waits for the controller.

    ``position`` is where it is in its data ([epoch, block, rows] or None between blocks),
    ``samples`` the rows it has read in this generation, ``next_epoch`` the epoch a restart from
    this report begins (the current one, or the next when its batches were all read).
    ``checkpoint``: the rank holds a state to write; ``sharded``: every rank wrote its shard of
    the state there already (``torch.distributed.checkpoint``), for the controller to adopt;
    ``reduce``: how the ranks' ``metrics`` are combined (None: rank 0's).
    """

    kind: ClassVar[str] = "reported"
    trainer: int
    id: int
    steps: int
    samples: int
    position: list[int] | None
    rng: str
    next_epoch: int
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: bool = False
    reduce: str | None = None
    sharded: str = ""


@dataclass(frozen=True)
class ShareDone(_Event):
    """A ``dt.run`` rank read its whole share of ``epoch`` after ``reports`` reports: until the
    epoch ends on every rank, the reports the others make inside their batch loops do not wait
    for it."""

    kind: ClassVar[str] = "share-done"
    trainer: int
    epoch: int
    reports: int


@dataclass(frozen=True)
class ReportReady(_Event):
    """Every running rank reported ``id`` (its :class:`Score`, if any, was emitted just before):
    the controller writes the checkpoint when ``checkpoint``, then lets the ranks go on."""

    kind: ClassVar[str] = "report-ready"
    id: int
    checkpoint: bool


@dataclass(frozen=True)
class Leaving(_Event):
    """The worker at ``address`` is leaving with notice (retired, scaled down, its lifetime
    over) and is held, for a bounded time, until the job has taken what it holds (sent by
    dask-train's worker plugin, :func:`~dask_train.runtime._plugin.hold_for_hand_over`)."""

    kind: ClassVar[str] = "leaving"
    address: str


Event = (Started | Block | Paused | Exit | Score | NonFinite | Stats | Epochs | Progress | Reported
         | ShareDone | ReportReady | Leaving)

_KINDS: dict[str, type[_Event]] = {
    cls.kind: cls for cls in (Started, Block, Paused, Exit, Score, NonFinite, Stats, Epochs, Progress,
                              Reported, ShareDone, ReportReady, Leaving)
}
_SCORE_FIELDS = ("kind", "step", "samples", "wall", "nonfinite", "worker")


def from_message(msg: Mapping[str, Any]) -> Event:
    """The record of a message sent by :meth:`message`.

    The scheduler stamps each worker's event with the sending ``"worker"``: kept by a score and
    in a role's stats, dropped from the other kinds.

    Raises
    ------
    ValueError
        For an unknown kind, a missing field or an unexpected one: a bug in the sender.
    """
    kind = msg.get("kind")
    cls = _KINDS.get(str(kind))
    if cls is None:
        raise ValueError(f"unknown engine event kind {kind!r}; expected one of {sorted(_KINDS)}")
    if cls is Score:
        return Score(step=int(msg["step"]), samples=int(msg["samples"]),
                     wall=float(msg.get("wall", 0.0)), nonfinite=list(msg.get("nonfinite") or []),
                     metrics={k: v for k, v in msg.items() if k not in _SCORE_FIELDS},
                     worker=msg.get("worker"))
    if cls is Stats:
        return Stats(role=str(msg["role"]), index=int(msg["index"]),
                     figures={k: v for k, v in msg.items() if k not in ("kind", "role", "index")})
    names = {f.name for f in dataclasses.fields(cls)}
    given = set(msg) - {"kind", "worker"}
    if not given <= names:
        raise ValueError(f"{kind} event with unexpected fields {sorted(given - names)}")
    event: Event = cls(**{k: msg[k] for k in given})  # type: ignore[assignment]
    return event
