"""What ``dt.run`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask_train.api._job_result import JobResult
from dask_train.errors import InvalidInput

if TYPE_CHECKING:

    pass


@dataclass(kw_only=True)
class RunResult(JobResult):
    """What ``dt.run`` returns.

    Attributes
    ----------
    returns : list
        What the function returned on each rank (of the last generation), by rank.
    history : pandas.DataFrame
        One row per ``ctx.report`` with metrics: ``time_s, step, epoch, samples`` and the metrics.
    stopped_by : str
        What ended the job: a stop condition's description, a callback, or ``"trainers ended"``
        when every rank's function returned.
    steps, samples : int
        Batches rank 0 took, and rows all ranks read (restored counts included).
    epochs_completed : int
        Epochs whose every row was read.
    wall_s : float
        Seconds from the first rank's start to the end of the job.
    ledger : pandas.DataFrame
        One row per (epoch, block) handed out: rank, rows, rows read.
    roles : Roles
        Where the ranks ran (``roles["trainer"][rank]``).
    ranks : list of dict
        Each rank's counts and where its time went.
    failures, checkpoints : list of dict
        Each lost rank (when, which worker, the cause, what the job did; ``notice`` as in
        :attr:`FitResult.failures <dask_train.FitResult.failures>`), each checkpoint written.
    departures : list of dict
        Each worker that left with notice while it held a rank, as
        :attr:`FitResult.departures <dask_train.FitResult.departures>`.
    arrivals : list of dict
        Each regroup onto workers that joined, up to ``workers=(least, most)``'s most, at a
        report with a checkpoint (as :attr:`FitResult.arrivals <dask_train.FitResult.arrivals>`).
    generations : int
        1, plus one per restart.
    timings : dict
        Seconds per phase, as :attr:`FitResult.timings <dask_train.FitResult.timings>`.
    started_at : float
        When the job started (``time.time()``): the origin of ``history.time_s``.
    """

    returns: list[Any]
    ranks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def checkpoint(self) -> str | None:
        """The newest checkpoint's directory, None when none was written."""
        return self.checkpoints[-1]["directory"] if self.checkpoints else None

    def load_checkpoint(self) -> Any:
        """The state the newest checkpoint holds, as the function reported it (None without).

        A sharded state (``ctx.report(sharded=True)``) is in ``torch.distributed.checkpoint``'s
        format: load it with ``torch.distributed.checkpoint.load`` (raises here)."""
        if self.checkpoint is None:
            return None
        import json

        import fsspec

        directory = self.checkpoint.rstrip("/")
        with fsspec.open(f"{directory}/manifest.json", "rb") as f:
            manifest = json.loads(f.read())
        if manifest.get("sharded"):
            raise InvalidInput([f"the checkpoint {directory} is sharded: load it with "
                                "torch.distributed.checkpoint.load(state, checkpoint_id="
                                f"'{directory}/{manifest['sharded']['dir']}') into a "
                                "state of the same structure, or ctx.restore(state) in dt.run."])
        from dask_train.checkpoint import load_state
        from dask_train.checkpoint._store import shard_name

        return load_state(f"{self.checkpoint.rstrip('/')}/{shard_name(0)}")
