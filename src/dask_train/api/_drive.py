"""The one way every job runs once its spec, engine, data and first roles are ready.

``Trainer.fit`` (torch and Keras, :mod:`dask_train.api._fit`; numpy,
:mod:`dask_train.api._fit_array`) and ``dt.run`` (:mod:`dask_train.api._run`) each build what
differs (the spec, how an engine is made, where roles go) and hand it to :func:`drive`, which
calls the start callbacks, runs the one controller through the sync wrapper under a progress
bar, builds the job's result and calls the end callbacks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from dask_train.controller._controller import Controller, MakeEngine, Outcome
from dask_train.controller._generations import PlanRoles
from dask_train.controller._progress import Progress
from dask_train.policy.callbacks import run_callbacks

if TYPE_CHECKING:
    from distributed import Client

    from dask_train.engines._spec import JobSpec
    from dask_train.policy._placement import Roles

R = TypeVar("R")


def drive(client: Client, spec: JobSpec, *, make_engine: MakeEngine, plan_roles: PlanRoles,
          roles: Roles, rows: int, params: Mapping[str, Any], resume: bool,
          result: Callable[[Outcome, float], R], placeholders: list[Any] | None = None,
          release: Callable[[], None] | None = None) -> R:
    """Run the job of ``spec`` under the controller and return ``result(outcome, wall_s)``.

    ``roles`` are the first generation's, ``rows`` the training rows; ``params`` is what the
    callbacks' ``on_fit_start`` records of the job's settings (``info["params"]``).
    ``placeholders``: tasks that asked an adaptive cluster for the job's workers, handed to
    the controller, which holds them until its ranks run (the list is emptied, so that the
    caller no longer cancels them). ``release`` frees the job's data once the controller is
    done with it, whether it ended or failed (before the result is built).
    """
    try:
        run_callbacks(spec.callbacks, "on_fit_start", {"roles": roles, "rows": rows,
                                                       "params": dict(params)})
        with Progress(total=spec.epochs * rows, enabled=spec.progress) as progress:
            started = time.time()
            controller = Controller(client, spec, make_engine=make_engine,
                                    plan_roles=plan_roles, roles=roles, rows=rows,
                                    progress=progress)
            if placeholders is not None:
                controller.wanted.adopt(placeholders)
                placeholders.clear()
            outcome = controller.run_sync(resume=resume)
            progress.close(outcome.stopped_by)
    finally:
        if release is not None:
            release()
    done = result(outcome, time.time() - started)
    run_callbacks(spec.callbacks, "on_fit_end", done)
    return done
