"""Measuring the per-step costs of an async-ps job on the cluster at hand, for the cost model.

Three measurements, each done the way the job itself will do the work:

* a trainer's step: the gradient of real batches of the user's module on a worker (``FlatModel``
  and the job's loss, as ``run_trainer`` computes it);
* a server's update: the job's optimizer over a flat vector of all the parameters on a worker
  (``FlatOptimizer``, as a shard applies it), per parameter;
* the link: an echo between two workers over a worker RPC handler, as pushes and pulls travel,
  once with a few bytes (the fixed cost of an exchange) and once with a payload (the rate).

:func:`probe_costs` turns them into a :class:`~dask_train.policy._cost.CostModel`. It takes about
a second (a few steps of the model, a few echoes), more for a model whose step is slow.
"""

from __future__ import annotations

import asyncio
import copy
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from distributed import Client, Worker, get_worker
from distributed.protocol import to_serialize

from dask_train.engines.holders.optim import FlatOptimizer
from dask_train.models._torch import model_inputs, resolve_loss

try:  # where FlatModel lives on main since the device work
    from dask_train.models._flat import FlatModel
except ImportError:  # before it: drop this fallback once the branches are merged
    from dask_train.models._torch import FlatModel  # type: ignore[attr-defined,no-redef]
from dask_train.policy._cost import CostModel
from dask_train.policy._settings import OptimizerSettings
from dask_train.runtime._plugin import worker_state
from dask_train.runtime._roles import ensure_plugin, worker_threads

#: Largest echo payload: enough to see a link's rate through its fixed costs, small enough to take
#: well under a second on a 1 Gbit/s link.
ECHO_MAX_BYTES = 8 * 2**20
#: A link faster than this (loopback) is taken as this: an echo of a few MB cannot resolve more.
FASTEST_LINK = 20e9


def make_echo_handler(worker: Worker) -> Any:
    """The ``dask_train_echo`` handler: send the payload back (a push and its reply, no update)."""

    async def dask_train_echo(payload: Any = None) -> dict[str, Any]:
        return {"payload": to_serialize(payload) if payload is not None else None}

    return dask_train_echo


def _time(fn: Callable[[], object], *, repeats: int, budget_s: float,
          summary: Callable[[list[float]], float] = statistics.median) -> float:
    """Seconds of ``fn()`` over up to ``repeats`` calls after one warm-up, within a budget."""
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < repeats and (not times or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return summary(times)


def time_step_task(module: torch.nn.Module, x: np.ndarray, y: np.ndarray, *, loss: Any,
                   optim: OptimizerSettings, budget_s: float = 2.0) -> dict[str, float]:
    """Dask task: seconds of one batch's gradient, and of an optimizer step per parameter."""
    worker_state(get_worker()).configure_torch()
    model = FlatModel(copy.deepcopy(module))
    model.module.train()
    loss_fn = resolve_loss(loss)
    out = torch.empty(model.n_params)
    xb, yb = model_inputs(x), model_inputs(y)  # several inputs: a dict or tuple
    compute = _time(lambda: model.gradient(xb, yb, loss_fn, out=out), repeats=5,
                    budget_s=budget_s)
    server = FlatOptimizer(model.flat.detach().numpy(), optim)
    server.grad.normal_()
    update = _time(lambda: server.step(1), repeats=5, budget_s=budget_s)
    return {"compute_s": compute, "update_s_per_param": update / model.n_params,
            "n_params": float(model.n_params)}


def echo_task(peer: str, *, nbytes: int, repeats: int = 5, timeout: float = 30.0
              ) -> dict[str, float]:
    """Dask task: fastest round trip to ``peer``'s echo handler with a few bytes and ``nbytes``."""
    worker = get_worker()
    loop = worker.loop.asyncio_loop  # type: ignore[attr-defined]

    def echo(payload: np.ndarray) -> None:
        call = worker.rpc(peer).dask_train_echo(payload=to_serialize(payload))
        asyncio.run_coroutine_threadsafe(call, loop).result(timeout)

    small, large = np.zeros(1, np.uint8), np.ones(max(nbytes, 1), np.uint8)
    # The fastest of a few: other work on a busy machine only ever adds to a round trip, and what
    # contention costs is the model's business (its bounds), not the probe's.
    return {
        "small_s": _time(lambda: echo(small), repeats=repeats, budget_s=5.0, summary=min),
        "large_s": _time(lambda: echo(large), repeats=repeats, budget_s=10.0, summary=min),
        "nbytes": float(large.nbytes),
    }


def _machine(dask_worker: Any = None) -> tuple[str, int]:
    return socket.gethostname(), os.cpu_count() or 1


def probe_costs(
    client: Client, module: torch.nn.Module, x: np.ndarray, y: np.ndarray, *, loss: Any,
    optim: OptimizerSettings, prefetch: int = 1,
    grad_accumulation: int = 1, timeout: float = 60.0,
) -> CostModel:
    """Measure a job's per-step costs on ``client``'s cluster; return the cost model.

    Parameters
    ----------
    client : distributed.Client
    module : torch.nn.Module
        The model (copied on the worker).
    x, y : numpy.ndarray
        One batch of real inputs and targets (its length is the batch size).
    loss
        As the Trainer takes it.
    optim : OptimizerSettings
        The optimizer, its learning rate and options.
    prefetch, grad_accumulation : int
        As the Trainer takes them: a step is ``grad_accumulation`` batches and one push.
    timeout : float
        Seconds any measurement may take.

    Returns
    -------
    CostModel
        ``hosts`` is the number of Dask workers (each a place for roles); when all of them run on
        one machine (a LocalCluster, network namespaces) ``shared_cores`` is its core count,
        otherwise ``cores_per_host`` is the fewest cores per worker of any machine.
        ``message_s`` is a small echo's whole round trip (latency included, so ``latency_s`` is
        0).
    """
    ensure_plugin(client)
    workers = sorted(worker_threads(client))
    machines = {w: tuple(m) for w, m in client.run(_machine).items()}  # (host name, cores)
    first = workers[0]
    step = client.submit(time_step_task, module, x, y, loss=loss, optim=optim,
                         workers=[first], pure=False
                         ).result(timeout)
    n_params = int(step["n_params"])
    # The peer: another machine when there is one (a host's link), else another worker.
    others = [w for w in workers[1:] if machines.get(w) != machines.get(first)] or workers[1:]
    if others:
        nbytes = int(min(ECHO_MAX_BYTES, max(4 * n_params, 2**16)))
        echo = client.submit(echo_task, others[0], nbytes=nbytes, timeout=timeout,
                             workers=[first], pure=False).result(timeout * 4)
        extra = max(echo["large_s"] - echo["small_s"], 1e-9)
        rate = min(2 * echo["nbytes"] / extra, FASTEST_LINK)  # the payload went and came back
        message_s = echo["small_s"]
    else:
        rate, message_s = FASTEST_LINK, 0.0
    by_machine: dict[tuple[Any, ...], int] = {}
    for w in workers:
        by_machine[machines[w]] = by_machine.get(machines[w], 0) + 1
    cores = {m: float(m[1]) for m in by_machine}
    one_machine = len(by_machine) == 1
    return CostModel(
        n_params=n_params, batch_size=len(x) * grad_accumulation,
        compute_s=step["compute_s"] * grad_accumulation,
        update_s_per_param=step["update_s_per_param"], link_bytes_per_s=rate,
        message_s=message_s, prefetch=prefetch, hosts=len(workers),
        cores_per_host=min(cores[m] / n for m, n in by_machine.items()),
        shared_cores=next(iter(cores.values())) if one_machine else None,
    )
