"""``dt.run``'s arguments as one checked record, :class:`RunJob`: the function and its config,
the named data sets, and the same data, cluster and recovery records a Trainer's fit builds."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dask_train.api._run_checks import check_data_sets, check_fn
from dask_train.api._run_sets import data_sets
from dask_train.api._settings import RecoverySettings
from dask_train.data._inputs import is_lazy
from dask_train.data._training import TrainingData
from dask_train.policy._settings import (
    ClusterSettings,
    DataSettings,
    callback_problems,
    stop_problems,
)

if TYPE_CHECKING:
    from dask_train.checkpoint import CheckpointConfig
    from dask_train.policy import Callback, FailureConfig, StopCondition


@dataclass(frozen=True)
class RunJob:
    """``dt.run``'s arguments by concern: the function and its config, the named data sets,
    and the same data, cluster and recovery records a Trainer's fit builds
    (:mod:`dask_train.policy._settings`, :mod:`dask_train.api._settings`), so each value is
    checked once, with one wording, whichever door it came through. The values are the
    user's, unchecked: :meth:`problems` says what is wrong with each."""

    fn: Callable[..., Any]
    config: Mapping[str, Any] | None
    #: The named data sets as every later step reads them (see
    #: :func:`~dask_train.api._run_sets.data_sets`).
    sets: Mapping[str, Any] | None
    data: DataSettings
    cluster: ClusterSettings
    recovery: RecoverySettings
    stop: Sequence[StopCondition] = ()
    callbacks: Sequence[Callback] = ()
    resume: bool = False
    data_mode: str = "auto"

    @classmethod
    def of(cls, fn: Callable[..., Any], *, data: Mapping[str, Any] | None,
           config: Mapping[str, Any] | None, workers: int | tuple[int, int] | None,
           epochs: int | None, batch_size: int, stop: Sequence[StopCondition] | None,
           callbacks: Sequence[Callback] | None,
           checkpoint: CheckpointConfig | str | os.PathLike[str] | None,
           failure: FailureConfig | None, resume: bool, seed: int, shuffle: bool,
           blocks_ahead: int | str, timeout: float, device: str, data_mode: str,
           resources: Mapping[str, float] | None) -> RunJob:
        """The record of ``dt.run``'s arguments, every one given: their defaults are
        ``dt.run``'s signature's alone (:func:`~dask_train.api._run.check_run` reads them)."""
        return cls(
            fn=fn, config=config, sets=data_sets(data),
            data=DataSettings(batch_size=batch_size, epochs=epochs, shuffle=shuffle, seed=seed,
                              blocks_ahead=blocks_ahead),
            cluster=ClusterSettings(workers=workers, device=device, timeout=timeout,
                                    resources=resources),
            # A rank's non-finite metric is reported, never a reason to stop: the function
            # decides what to do about its own loss.
            recovery=RecoverySettings(checkpoint=checkpoint, failure=failure, on_nan="skip"),
            stop=stop or (), callbacks=callbacks or (), resume=bool(resume), data_mode=data_mode)

    def problems(self) -> list[str]:
        """Every problem with the arguments (nothing is sent anywhere)."""
        from dask_train.policy._data_mode import check_data_mode

        problems = check_fn(self.fn, self.config)
        problems += check_data_sets(self.sets)
        sets = self.sets if isinstance(self.sets, Mapping) else {}
        first = next(iter(sets.values()), None)
        if isinstance(first, TrainingData):
            in_memory = first.in_memory
        else:  # not readable: its problems are listed above
            x = first[0] if isinstance(first, tuple) and len(first) == 2 else first
            in_memory = x is not None and not is_lazy(x)
        problems += check_data_mode(self.data_mode, full_batch=False, name="data_mode",
                                    in_memory=in_memory)
        problems += self.cluster.problems(ranges=True)
        problems += self.data.problems()
        problems += stop_problems(self.stop)
        problems += callback_problems(self.callbacks)
        problems += self.recovery.problems()
        if self.resume and self.recovery.checkpoint is None:
            problems.append("resume=True needs checkpoint=dt.CheckpointConfig(path) (or a "
                            "directory): it continues from the newest checkpoint under that path.")
        return problems

