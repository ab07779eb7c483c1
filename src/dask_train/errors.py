"""One exception root for dask-train, with subclasses a user would also catch by built-in type."""

from __future__ import annotations

import traceback
from collections.abc import Iterable


class DaskTrainError(Exception):
    """Root of every error raised by dask-train."""


class InvalidInput(DaskTrainError, ValueError):
    """One or more arguments or data are invalid; every problem is listed in the message.

    Parameters
    ----------
    problems : iterable of str
        One sentence per problem, each naming the parameter, the value and the fix.

    Examples
    --------
    >>> err = InvalidInput(["batch_size=0 is invalid: use an integer >= 1."])
    >>> err.problems
    ['batch_size=0 is invalid: use an integer >= 1.']
    """

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{len(self.problems)} problems with the input:\n{lines}"
        super().__init__(message)


class ClusterUnreachable(DaskTrainError, TimeoutError):
    """The Dask scheduler could not be reached within the timeout."""


class ClusterMismatch(InvalidInput):
    """The cluster's processes do not run the client's software (dask-train, Dask, torch...).

    Examples
    --------
    >>> ClusterMismatch(["worker tcp://w:1 runs torch 2.4.0, the client 2.13.0: ..."]).problems[0][:15]
    'worker tcp://w:'
    """


class DataUnreadable(InvalidInput):
    """Workers cannot read the training data (found before training, by reading one block on
    each of them); every worker that failed is named with the cause and the fix.

    Examples
    --------
    >>> DataUnreadable(["worker tcp://w:1 cannot read block 0: ..."]).problems[0][:15]
    'worker tcp://w:'
    """


class DataDoesNotFit(DaskTrainError, MemoryError):
    """Persisting the data stalled because the workers that must hold it are paused at their
    memory limit; the message names them, their limits, and ``data="stream"``."""


class BlockReadError(DaskTrainError, RuntimeError):
    """A block of streamed training data could not be read on a worker, after its retries;
    the message names the block, its Dask key, the worker and the cause (chained)."""


class WorkerLost(DaskTrainError, RuntimeError):
    """A Dask worker holding a training role left the cluster.

    Parameters
    ----------
    message : str
        What happened and what to do.
    worker : str
        The address of the lost worker.
    role : str
        The role it held, e.g. ``"trainer-0"`` or ``"ps-1"``.
    """

    def __init__(self, message: str, *, worker: str = "", role: str = "") -> None:
        super().__init__(message)
        self.worker = worker
        self.role = role


class ParameterServerLost(WorkerLost):
    """The Dask worker holding a parameter-server shard left the cluster."""


class TrainingTimeout(DaskTrainError, TimeoutError):
    """A role did not answer within its timeout."""


class RoleFailed(DaskTrainError, RuntimeError):
    """A role raised an exception on its worker; the original is chained as ``__cause__``."""


class NonFiniteLoss(DaskTrainError, ValueError):
    """A job ended without one finite step: its first loss was NaN or infinite, so it has no
    trained parameters to return. The message names the step, the trainer and the block, and
    the fix (clean the data, or ``on_nan="skip"``).

    A job that made finite steps before a non-finite loss does not raise: it returns the last
    good parameters, with the losses in ``FitResult.nonfinite``.

    Parameters
    ----------
    message : str
        What happened and what to do.
    step, trainer, block, epoch, loss
        Where the first non-finite loss came from (``block``/``epoch`` -1: not known).

    Examples
    --------
    >>> err = NonFiniteLoss("...", step=0, trainer="trainer-0", block=3, epoch=0, loss="nan")
    >>> err.trainer, err.block, isinstance(err, ValueError)
    ('trainer-0', 3, True)
    """

    def __init__(self, message: str, *, step: int, trainer: str, block: int = -1,
                 epoch: int = -1, loss: str = "nan") -> None:
        super().__init__(message)
        self.step, self.trainer, self.block, self.epoch, self.loss = step, trainer, block, epoch, loss


__all__ = [
    "BlockReadError",
    "ClusterUnreachable",
    "DaskTrainError",
    "DataUnreadable",
    "InvalidInput",
    "NonFiniteLoss",
    "ParameterServerLost",
    "RoleFailed",
    "TrainingTimeout",
    "WorkerLost",
]


def release_frames(error: BaseException) -> None:
    """Drop the local variables of the finished frames ``error`` (and the errors it chains)
    went through; the traceback keeps its file names and line numbers.

    Why: an error's frames hold what the failed code was using (a job's engine and futures in
    the client; a role's tensors, some viewing shared memory, on a worker), and an error is
    often in a reference cycle (distributed's ``sync`` keeps the error it re-raises in a closure
    its own traceback holds), freed only when Python's cycle collector runs: until then the
    scheduler kept a failed job's tasks and a worker the failed role's memory."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        todo += [exc.__cause__, exc.__context__]
