"""Checks of ``dt.search``'s arguments, and the choice of trial runner for the model given."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

from distributed import Client

from dask_train.policy.stop import StopCondition, _infer_mode
from dask_train.tuning._space import Space
from dask_train.tuning._trial import TrialRunner

#: XGBoost evaluation metrics where higher is better (the others are errors and losses).
XGB_MAXIMISED = ("accuracy", "auc", "aucpr", "map", "ndcg", "pre")
PRUNERS = ("asha", "none")


def _count(name: str, value: Any, *, optional: bool) -> list[str]:
    if optional and value is None:
        return []
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return [f"{name}={value!r} is invalid: use an integer >= 1" +
                (" or None." if optional else ".")]
    return []


def check_arguments(*, n_trials: Any, max_concurrent: Any, workers_per_trial: Any, timeout: Any,
                    mode: Any, validation: Any, stop: Sequence[Any], sampler: Any,
                    retries: Any = 0) -> list[str]:
    """Every problem with the plain arguments of ``dt.search``."""
    problems = _count("n_trials", n_trials, optional=False)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        problems.append(f"retries={retries!r} is invalid: use an integer >= 0 (the times a "
                        "trial that lost a worker runs again; 0 records it as failed).")
    problems += _count("max_concurrent", max_concurrent, optional=True)
    problems += _count("workers_per_trial", workers_per_trial, optional=True)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not math.isfinite(timeout) or timeout <= 0:
        problems.append(f"timeout={timeout!r} is invalid: use a number of seconds > 0.")
    if mode not in (None, "max", "min"):
        problems.append(f"mode={mode!r} is invalid: use 'max', 'min' or None to infer it.")
    if not isinstance(validation, (tuple, list)) or len(validation) != 2:
        problems.append(f"validation={type(validation).__name__} is invalid: pass (X_val, y_val); "
                        "every trial is scored on it.")
    problems += [f"stop contains {c!r}: use dt.StopAfter, dt.StopAtScore or another "
                 "dt.StopCondition." for c in stop if not isinstance(c, StopCondition)]
    if sampler is not None and not callable(getattr(sampler, "sample_independent", None)):
        problems.append(f"sampler={sampler!r} is invalid: pass an optuna sampler such as "
                        "optuna.samplers.TPESampler(seed=0), or None.")
    return problems


def make_pruner(pruner: Any, problems: list[str]) -> Any:
    """optuna's pruner for ``pruner=`` (appends to ``problems`` instead when it is invalid)."""
    try:
        import optuna
    except ImportError:
        problems.append("dt.search needs optuna: pip install 'dask-train[search]'.")
        return None
    if pruner is None or pruner == "none":
        return optuna.pruners.NopPruner()
    if pruner == "asha":
        # Steps are thousandths of a trial's planned training (see _trial.STEPS): rungs at 10%,
        # 30% and 90%, keeping the best third at each. A fixed min_resource, not optuna's
        # "auto": that one is known only once a trial completed, and trials running meanwhile
        # would record their rung values late, at their last score.
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=100, reduction_factor=3)
    if isinstance(pruner, optuna.pruners.BasePruner):
        return pruner
    problems.append(f"pruner={pruner!r} is invalid: use one of {', '.join(map(repr, PRUNERS))}, "
                    "None or an optuna pruner (optuna.pruners.SuccessiveHalvingPruner(...)).")
    return None


def stop_problems(stop: Sequence[StopCondition], metric: Any) -> list[str]:
    """A stop condition on a score must watch the search's metric."""
    problems = []
    for condition in stop:
        watched = getattr(condition, "metric", metric)
        if watched != metric:
            problems.append(f"stop={condition!r} watches {watched!r} but the search optimises "
                            f"metric={metric!r}: stop on {metric!r}.")
    return problems


def _kind(model: Any) -> str:
    trainer_module = sys.modules.get("dask_train.api._trainer")
    if trainer_module is not None and isinstance(model, trainer_module.Trainer):
        return "trainer"
    module = type(model).__module__
    if module.startswith("xgboost.dask"):
        return "xgboost"
    if module.startswith("dask_train.classical"):
        return "glm"
    return "estimator"


def make_runner(model: Any, space: Space, *, data: Any, metric: Any, mode: str | None,
                client: Client, workers_per_trial: int | None, timeout: float
                ) -> tuple[Any, str, TrialRunner]:
    """(metric, mode, runner) for ``model``: defaults filled in from the kind of model."""
    kind = _kind(model)
    if kind == "trainer":
        from dask_train.models._torch import is_classification
        from dask_train.tuning._trainer_trials import TrainerTrials

        metric = metric or ("accuracy" if is_classification(model.loss) else "loss")
        mode = mode or (_infer_mode(metric) if isinstance(metric, str) else "max")
        return metric, mode, TrainerTrials(model, space, data=data, metric=metric, client=client,
                                           workers_per_trial=workers_per_trial)
    from sklearn.base import is_classifier

    classifier = is_classifier(model)
    if kind == "xgboost":
        from dask_train.tuning._xgb import XGBoostTrials

        metric = metric or ("accuracy" if classifier else "rmse")
        mode = mode or ("max" if metric in XGB_MAXIMISED else "min")
        return metric, mode, XGBoostTrials(model, space, data=data, metric=metric, client=client,
                                           workers_per_trial=workers_per_trial)
    from dask_train.tuning._estimator_trials import EstimatorTrials, GLMTrials

    # scikit-learn scorers are all "greater is better" (losses are negated: neg_log_loss).
    metric = metric or ("accuracy" if classifier else "r2")
    mode = mode or "max"
    if kind == "glm":
        return metric, mode, GLMTrials(model, space, data=data, metric=metric, client=client,
                                       workers_per_trial=workers_per_trial)
    return metric, mode, EstimatorTrials(model, space, data=data, metric=metric, client=client,
                                         workers_per_trial=workers_per_trial)
