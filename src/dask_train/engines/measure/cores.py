"""How many cores a job's trainers really get on a machine others share: measured, not counted.

``os.cpu_count()`` says how many cores a machine has, not how many a job can use now: on a
machine shared with other programs (a loaded CI runner, a workstation), two trainers on two
cores may get little more than one between them, and a prediction that counts two favours
distributing where one process is faster. So the trainers' own step is run, for a few tens of
milliseconds, on one worker alone and then on every worker at once, from the same moment: the
steps per second of all of them together over the one's alone are the cores the job gets.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import torch
from distributed import get_worker

from dask_train.models._flat import FlatModel
from dask_train.models._torch import model_inputs, resolve_loss
from dask_train.runtime._plugin import worker_state


def prepared_step(module: torch.nn.Module, x: np.ndarray, y: np.ndarray, *, loss: Any
                  ) -> tuple[FlatModel, Any, Any, Any, torch.Tensor]:
    """On a worker, what a measured step needs: a training copy of ``module``, the loss, the
    batch as tensors and a zeroed flat gradient buffer, torch's threads set as for the job."""
    worker_state(get_worker()).configure_torch()
    model = FlatModel(copy.deepcopy(module))
    model.module.train()
    return model, resolve_loss(loss), model_inputs(x), model_inputs(y), \
        torch.zeros(model.n_params)


def step_rate_task(module: torch.nn.Module, x: np.ndarray, y: np.ndarray, *, loss: Any,
                   start_at: float, duration_s: float) -> float:
    """Dask task: gradients per second of ``module`` on one batch, from ``start_at`` (a
    ``time.time()``, the same clock on every worker of one machine) for ``duration_s``."""
    model, loss_fn, xb, yb, out = prepared_step(module, x, y, loss=loss)
    model.gradient(xb, yb, loss_fn, out=out)  # warm: the first call allocates
    time.sleep(max(0.0, start_at - time.time()))
    steps, started = 0, time.perf_counter()
    while True:
        model.gradient(xb, yb, loss_fn, out=out)
        steps += 1
        elapsed = time.perf_counter() - started
        if elapsed >= duration_s:
            return steps / elapsed
