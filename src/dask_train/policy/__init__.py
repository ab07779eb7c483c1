"""Pure policies over plain records: stop conditions, callbacks, the failure policy, the data
ledger, role placement, the cost model of parameter-server training. Nothing here imports Dask's
distributed runtime or an ML framework, so every rule is tested without a cluster.
"""

from dask_train.policy._cost import CostModel, Measured, Prediction, Recommendation, calibrate
from dask_train.policy._failure import Action, Decision, Failure, FailureConfig, JobStatus, decide
from dask_train.policy._ledger import Assignment, Block, Ledger, LedgerEntry
from dask_train.policy._placement import (
    Placement,
    Roles,
    balance_blocks,
    check_role_counts,
    plan_roles,
)
from dask_train.policy.callbacks import Callback, History, run_callbacks
from dask_train.policy.stop import (
    EarlyStopping,
    StopAfter,
    StopAtScore,
    StopAtStep,
    StopCondition,
    check_stop,
)

__all__ = [
    "Action",
    "Assignment",
    "Block",
    "Callback",
    "CostModel",
    "Decision",
    "EarlyStopping",
    "Failure",
    "FailureConfig",
    "History",
    "JobStatus",
    "Ledger",
    "LedgerEntry",
    "Measured",
    "Placement",
    "Prediction",
    "Recommendation",
    "Roles",
    "StopAfter",
    "StopAtScore",
    "StopAtStep",
    "StopCondition",
    "balance_blocks",
    "calibrate",
    "check_role_counts",
    "check_stop",
    "decide",
    "plan_roles",
    "run_callbacks",
]
