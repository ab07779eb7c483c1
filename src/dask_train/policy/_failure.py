"""The failure policy: a pure function from a job's status after a lost worker to a decision.

The controller builds a :class:`JobStatus` when a worker holding a role leaves, asks :func:`decide`,
and acts; the rules live here, apart from any cluster, so that every case is tested as a table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dask_train.errors import InvalidInput, ParameterServerLost, WorkerLost
from dask_train.policy._placement import KINDS, SEED_TRAINER


class Action(enum.Enum):
    """What the controller does about a lost role."""

    CONTINUE = "continue"  # drop the lost role; the survivors go on (async trainers)
    REPLACE = "replace"  # start the same role again on another live worker (the scorer)
    RESTART = "restart"  # a new generation: every role re-placed, state from the last checkpoint
    RAISE = "raise"  # stop the job with a typed error


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class FailureConfig:
    """How many lost workers a job survives.

    Parameters
    ----------
    max_failures : int
        Losses handled (continued, replaced or restarted from a checkpoint) before the job stops
        with :class:`~dask_train.errors.WorkerLost`; 0 raises at the first loss. A lost worker
        is one loss whatever roles it held (a trainer and the scorer); a role that raises on a
        live worker is one too.

    Examples
    --------
    >>> FailureConfig(max_failures=5).max_failures
    5
    """

    max_failures: int = 3

    def __post_init__(self) -> None:
        if not (_is_int(self.max_failures) and self.max_failures >= 0):
            raise InvalidInput(
                [f"FailureConfig(max_failures={self.max_failures!r}): max_failures must be an integer "
                 ">= 0 (how many lost workers the job survives; 0 raises at the first)."]
            )


@dataclass(frozen=True)
class Failure:
    """One lost role.

    Parameters
    ----------
    kind : {"trainer", "ps", "scorer"}
        ``"trainer"`` is an async-ps trainer or a sync or ``dt.run`` rank (``"worker"``, the
        seed's name, is read as ``"trainer"``).
    index : int
        The role's index, e.g. 0 for ``"ps-0"``.
    worker : str
        The address of the lost Dask worker.
    cause : str
        What was observed, e.g. ``"removed from the scheduler"``.
    """

    kind: str
    index: int
    worker: str
    cause: str

    def __post_init__(self) -> None:
        if self.kind == SEED_TRAINER:
            object.__setattr__(self, "kind", "trainer")
        problems = []
        if self.kind not in KINDS:
            problems.append(f"Failure(kind={self.kind!r}): kind must be one of {list(KINDS)}.")
        if not (_is_int(self.index) and self.index >= 0):
            problems.append(f"Failure(index={self.index!r}): index must be an integer >= 0.")
        if problems:
            raise InvalidInput(problems)

    @property
    def role(self) -> str:
        """The role's name, e.g. ``"ps-0"``."""
        return f"{self.kind}-{self.index}"


@dataclass(frozen=True)
class JobStatus:
    """The job as the controller sees it right after a loss.

    Parameters
    ----------
    strategy : str
        The engine's name (``"async-ps"``, ``"sync"``, ``"run"`` for a ``dt.run`` job), as the
        reasons name it; what the job can do is said by ``independent_trainers`` and
        ``reports_state`` (the controller reads them off the engine's capabilities).
    failure : Failure
        The loss being decided.
    failures : int
        Losses so far in this job, this one included (a lost worker counts once, whatever
        roles it held).
    live_trainers : int
        Trainers still running after this loss.
    live_workers : int
        Dask workers alive now.
    has_checkpoint : bool
        Whether a complete checkpoint exists to restart from.
    survivors_hold_state : bool
        Whether the surviving trainers hold the state to go on from in memory (sync ranks:
        each holds the parameters, the optimizer state and every rank's data position at the
        last step all applied).
    notice : bool
        Whether the worker left with notice (no hand-over could be made: the job was starting
        or stopping). Acted on as a loss, it is not one of ``failures`` and ``max_failures``
        does not count it.
    independent_trainers : bool
        Whether the trainers go on without a lost one (async-ps, an ``Elastic`` engine: the
        servers hold the state, each trainer its own blocks); False: the ranks form a group
        that needs every rank.
    reports_state : bool
        Whether the ranks say when their state is checkpointed, at their reports (``dt.run``:
        a ``Reporting`` engine), rather than being paused for it.
    """

    strategy: str
    failure: Failure
    failures: int
    live_trainers: int
    live_workers: int
    has_checkpoint: bool
    survivors_hold_state: bool = False
    notice: bool = False
    independent_trainers: bool = False
    reports_state: bool = False

    def __post_init__(self) -> None:
        problems = [
            f"JobStatus({name}={value!r}): {name} must be an integer >= {low}."
            for name, value, low in [
                ("failures", self.failures, 0 if self.notice else 1),
                ("live_trainers", self.live_trainers, 0),
                ("live_workers", self.live_workers, 0),
            ]
            if not (_is_int(value) and value >= low)
        ]
        if problems:
            raise InvalidInput(problems)


@dataclass(frozen=True)
class Decision:
    """The policy's answer: what to do, and why (with the fix when it is RAISE)."""

    action: Action
    reason: str


def decide(status: JobStatus, config: FailureConfig) -> Decision:
    """Decide what to do about a lost role.

    Rules, first match wins: more than ``max_failures`` losses (one with notice is not
    counted), or no live worker, raise; a lost scorer is replaced; an independent (async)
    trainer with other trainers still running is dropped and the job continues; otherwise (the
    last async trainer, a parameter server, any rank of a group) the job restarts from the state its
    surviving sync ranks hold, else from its last checkpoint, else from the initial
    parameters.

    Parameters
    ----------
    status : JobStatus
    config : FailureConfig

    Returns
    -------
    Decision

    Examples
    --------
    >>> lost = Failure("ps", 0, "tcp://10.0.0.5:4000", "removed from the scheduler")
    >>> status = JobStatus("async-ps", lost, failures=1, live_trainers=2, live_workers=3,
    ...                    has_checkpoint=True, independent_trainers=True)
    >>> decide(status, FailureConfig()).action
    <Action.RESTART: 'restart'>
    """
    failure = status.failure
    if not status.notice and status.failures > config.max_failures:
        return Decision(
            Action.RAISE,
            f"failure {status.failures} is more than max_failures={config.max_failures}: find why "
            "workers die (worker logs, memory limits), or raise FailureConfig(max_failures=...)",
        )
    if status.live_workers == 0:
        then = "then fit(..., resume=True)" if status.has_checkpoint else "then fit again"
        return Decision(
            Action.RAISE, f"no Dask worker is alive to go on with: restart or scale the cluster, {then}"
        )
    if failure.kind == "scorer":
        return Decision(Action.REPLACE, "the scorer holds no training state: it is started on another worker")
    if status.independent_trainers and failure.kind == "trainer" and status.live_trainers >= 1:
        return Decision(
            Action.CONTINUE,
            f"{status.live_trainers} trainer(s) go on and read the blocks {failure.role} had not consumed",
        )
    if failure.kind == "ps":
        what = "the parameter server's shard of the parameters and optimizer state was lost"
    elif status.independent_trainers:
        what = "no trainer is left"
    elif status.reports_state:
        what = "the dt.run job's ranks form one process group, which needs every rank"
    else:
        what = f"the {status.strategy} group needs every rank"
    if status.survivors_hold_state and failure.kind == "trainer" and status.live_trainers >= 1:
        fallback = "the last checkpoint" if status.has_checkpoint else "the initial parameters"
        held = "its last report" if status.reports_state else "the last step all applied"
        return Decision(Action.RESTART, f"{what}: a new generation goes on from the state the "
                                        f"surviving ranks hold at {held} (from {fallback} if "
                                        "they cannot give it)")
    if status.has_checkpoint:
        return Decision(Action.RESTART, f"{what}: a new generation restarts from the last checkpoint")
    # As TorchElastic and Ray Train do: the initial parameters are known, so a loss before the
    # first checkpoint costs the work done so far, not the job.
    return Decision(Action.RESTART, f"{what}: no checkpoint was written yet, so a new generation "
                                    "starts again from the initial parameters (the samples trained "
                                    "so far are trained again)")


def failure_error(status: JobStatus, decision: Decision) -> WorkerLost:
    """The typed error for a lost role: :class:`ParameterServerLost` for a server, else WorkerLost.

    Parameters
    ----------
    status : JobStatus
    decision : Decision
        Usually a RAISE from :func:`decide`; its reason carries the fix.

    Returns
    -------
    WorkerLost
        Names the worker, the role, the cause and the reason; ``.worker`` and ``.role`` are set.

    Examples
    --------
    >>> lost = Failure("trainer", 1, "tcp://10.0.0.7:4000", "removed from the scheduler")
    >>> status = JobStatus("sync", lost, failures=1, live_trainers=1, live_workers=1,
    ...                    has_checkpoint=False)
    >>> err = failure_error(status, decide(status, FailureConfig()))
    >>> err.role
    'trainer-1'
    """
    failure = status.failure
    message = (
        f"{failure.role} on Dask worker {failure.worker} was lost ({failure.cause}); "
        f"failure {status.failures} of the job: {decision.reason}."
    )
    cls = ParameterServerLost if failure.kind == "ps" else WorkerLost
    return cls(message, worker=failure.worker, role=failure.role)
