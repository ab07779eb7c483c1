"""The one builder of a job's :class:`~dask_train.engines._spec.JobSpec` from its settings.

A Trainer's fit (:class:`~dask_train.api._settings.Settings`) and ``dt.run``
(:class:`~dask_train.api._run_job.RunJob`) hold the same data, cluster and recovery records,
stop conditions and callbacks (:class:`JobSettings`); each job's spec is built here from them,
with what only that job knows: its engine, its trainers, its batch, its devices, and its own
part (the model a Trainer trains, ``dt.run``'s function's settings).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from dask_train.api._job_config import copy_every_s, memory_state
from dask_train.engines._spec import JobSpec, TrainSettings

if TYPE_CHECKING:
    from dask_train.api._settings import RecoverySettings
    from dask_train.engines.run.context import RunSettings
    from dask_train.policy._settings import ClusterSettings, DataSettings
    from dask_train.policy.callbacks import Callback
    from dask_train.policy.stop import StopCondition
    from dask_train.runtime._devices import Devices


class JobSettings(Protocol):
    """What the settings of every job hold, whichever door it came through."""

    @property
    def data(self) -> DataSettings: ...  # noqa: D102

    @property
    def cluster(self) -> ClusterSettings: ...  # noqa: D102

    @property
    def recovery(self) -> RecoverySettings: ...  # noqa: D102

    @property
    def stop(self) -> Sequence[StopCondition]: ...  # noqa: D102

    @property
    def callbacks(self) -> Sequence[Callback]: ...  # noqa: D102


def build_spec(settings: JobSettings, *, strategy: str, workers: int, most_workers: int | None,
               batch_size: int, epochs: int, devices: Devices | None = None,
               train: TrainSettings | None = None, run: RunSettings | None = None,
               progress: bool = False, data_note: str = "") -> JobSpec:
    """The spec of a job of these checked ``settings``.

    ``strategy`` is what the job reports (:attr:`EngineEntry.strategy
    <dask_train.engines._registry.EngineEntry.strategy>`); ``workers`` its trainers (ranks)
    and ``most_workers`` the most that joining workers may bring it to; ``batch_size`` the rows
    of one trainer's batch; ``devices`` the probed devices (None: the CPU); ``train`` the model
    a Trainer's engine trains, ``run`` what ``dt.run``'s ranks get; ``data_note`` how the data
    reaches the trainers, for the Training page. The Dask config of the job's in-memory
    state (``dask-train.copy-every``, ``dask-train.memory-state``) is read here, once.
    """
    data, cluster, recovery = settings.data, settings.cluster, settings.recovery
    ahead, most_ahead = data.read_ahead()
    return JobSpec(
        strategy=strategy, workers=int(workers), most_workers=most_workers,
        placement=cluster.placement, batch_size=int(batch_size), epochs=int(epochs),
        shuffle=bool(data.shuffle), seed=int(data.seed), blocks_ahead=ahead,
        blocks_ahead_max=most_ahead, timeout=float(cluster.timeout), stop=list(settings.stop),
        callbacks=list(settings.callbacks), train=train, run=run, progress=bool(progress),
        checkpoint=recovery.checkpoint_config(), failure=recovery.failure_config(),
        on_nan=str(recovery.on_nan), data=data_note,
        device_kind=devices.kind if devices is not None else "cpu",
        devices=dict(devices.by_worker) if devices is not None else {},
        precision=devices.precision if devices is not None else None,
        copy_every_s=copy_every_s(), memory_state=memory_state())
