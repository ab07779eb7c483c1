"""Scoring a validation set that stays on the cluster (``fit(validation=(dask X, dask y))``).

A validation set given as dask arrays is persisted as co-located blocks spread over the workers,
like the training data, and never comes to the client or to one process. For each score the
scorer pulls the parameters once and sends them to every worker holding validation blocks
(``dask_train_evaluate``, one RPC each, in parallel); each evaluates its own blocks off its event
loop and answers with sums (loss, correct predictions, rows), so a score costs one message of
parameters per holder and a few numbers back. Metrics that are not sums (functions of the whole
output, torchmetrics objects) need the outputs: then the holders send their outputs and targets
and the scorer computes those metrics over all of them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from distributed.protocol import to_serialize

from dask_train.models._outputs import join, to_host
from dask_train.models._torch import call_module
from dask_train.models._transport import unwrap
from dask_train.runtime._compat import worker_data
from dask_train.runtime._plugin import worker_state

if TYPE_CHECKING:
    from dask_train.engines._spec import RoleConfig


class Evaluator:
    """A holder's copy of the job's model, for evaluating the blocks it holds."""

    def __init__(self, module: Any, device: str | None, precision: str | None) -> None:
        import copy

        from dask_train.models._flat import flat_model

        self.model = flat_model(copy.deepcopy(module), device=device, precision=precision)
        self.buffers = self.model.buffers()
        self.lock = threading.Lock()  # one evaluation at a time writes the parameters

    def run(self, pairs: Sequence[Any], params: np.ndarray, buffers: Any, *, loss: Any,
            outputs: bool) -> dict[str, Any]:
        """Sums over ``pairs``: rows, loss * rows, and accuracy * rows where it applies."""
        import torch

        cpu = time.thread_time()  # this executor thread's: the scorer's share of this worker
        with self.lock:
            self.model.write_slices([(0, len(params), params)])
            self.buffers.scatter(buffers)
            sums: dict[str, float] = {}
            rows, outs, targets = 0, [], []
            for pair in pairs:
                x, y = pair[0], pair[1]
                scores = self.model.evaluate(x, y, loss=loss)
                for name, value in scores.items():
                    sums[name] = sums.get(name, 0.0) + float(value) * len(x)
                rows += len(x)
                if outputs:  # the whole output: metric functions pick what they need
                    module = self.model.module.eval()
                    with torch.no_grad():
                        outs.append(to_host(call_module(module, self.model.batch(x, y)[0])))
                    targets.append(np.asarray(y))
        reply: dict[str, Any] = {"rows": rows, "sums": sums,
                                 "cpu_s": time.thread_time() - cpu}
        if outputs and outs:
            reply["outputs"] = to_serialize(join(outs, [len(t) for t in targets]))
            reply["targets"] = to_serialize(np.concatenate(targets))
        return reply


def make_evaluate_handler(worker: Any) -> Any:
    """The worker's ``dask_train_evaluate`` RPC handler (see the module docstring)."""

    async def dask_train_evaluate(*, job: str, keys: list[str], params: Any, buffers: Any = None,
                                  module: Any = None, device: str | None = None,
                                  precision: str | None = None, loss: Any = None,
                                  outputs: bool = False) -> dict[str, Any]:
        state = worker_state(worker)
        if job in state.ended:
            return {"ended": True}
        evaluator = state.evaluators.get(job)
        if evaluator is None:
            if module is None:
                return {"need_module": True}
            evaluator = state.evaluators.setdefault(job, Evaluator(unwrap(module), device,
                                                                   precision))
        data = worker_data(worker)
        missing = [k for k in keys if k not in data]
        pairs = [data[k] for k in keys if k in data]
        loop = asyncio.get_running_loop()
        # Off the event loop: evaluating blocks takes long enough to starve heartbeats.
        reply: dict[str, Any] = await loop.run_in_executor(
            None, lambda: evaluator.run(pairs, np.asarray(params), buffers, loss=loss,
                                        outputs=outputs))
        reply["missing"] = missing
        return reply

    return dask_train_evaluate


class SpreadValidation:
    """The scorer's side: where the validation blocks are, and one evaluation over all of them.

    Parameters
    ----------
    worker : distributed.Worker
        The scorer's worker (its event loop and RPC pool carry the calls).
    job : str
    keys : list of str
        The persisted validation blocks (see ``data.persist_pairs``).
    module : object
        The job's model, sent once to each holder.
    config : RoleConfig
        The job's settings (loss, metrics, devices, precision, timeout).
    """

    def __init__(self, worker: Any, *, job: str, keys: Sequence[str], module: Any,
                 config: RoleConfig) -> None:
        self.worker, self.job, self.keys, self.module = worker, job, list(keys), module
        self.config = config
        self.holders: dict[str, list[str]] = {}
        self.has_module: set[str] = set()
        self.rows_by_worker: dict[str, int] = {}
        self.cpu_s = 0.0  # CPU the holders spent evaluating, not yet taken by take_cpu

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.worker.loop.asyncio_loop).result(
            self.config.timeout)

    async def _locate(self) -> None:
        who_has = await self.worker.scheduler.who_has(keys=self.keys)
        holders: dict[str, list[str]] = {}
        for key in self.keys:
            where = sorted(who_has.get(key) or [])
            if not where:
                # Not held anywhere right now (being moved, or recomputed after a loss): a score
                # over the blocks found would leave rows out; none this time, look again next.
                self.holders = {}
                return
            holders.setdefault(where[0], []).append(key)
        self.holders = holders

    async def _evaluate(self, params: np.ndarray, buffers: Any, outputs: bool) -> list[Any]:
        config = self.config

        async def one(address: str, keys: list[str]) -> Any:
            for _ in range(2):
                kwargs: dict[str, Any] = {}
                if address not in self.has_module:
                    kwargs = {"module": to_serialize(self.module),
                              "device": config.devices.get(address),
                              "precision": config.precision}
                reply = await self.worker.rpc(address).dask_train_evaluate(
                    job=self.job, keys=keys, params=to_serialize(params),
                    buffers=None if buffers is None else to_serialize(buffers),
                    loss=to_serialize(config.trains.loss), outputs=outputs, **kwargs)
                self.has_module.add(address)
                if not reply.get("need_module"):
                    return reply
                self.has_module.discard(address)  # the worker restarted: send the model again
            return reply

        if not self.holders:
            await self._locate()
        return list(await asyncio.gather(*(one(a, k) for a, k in self.holders.items())))

    def take_cpu(self) -> float:
        """CPU seconds the holders spent evaluating since the last call."""
        spent, self.cpu_s = self.cpu_s, 0.0
        return spent

    def score(self, params: np.ndarray, buffers: Any) -> dict[str, float] | None:
        """The validation scores of ``params``; None when some block could not be found (a
        worker was lost, or a block is moving: Dask recomputes or moves the blocks, and the next
        score finds them)."""
        from dask_train.models._evaluate import extra_metrics

        metrics = {k: m for k, m in (self.config.trains.metrics or {}).items()
                   if not isinstance(m, str)}
        replies = self._call(self._evaluate(params, buffers, bool(metrics)))
        self.cpu_s += sum(float(r.get("cpu_s", 0.0)) for r in replies or [])
        if not replies or any(r.get("missing") or "rows" not in r for r in replies):
            self.holders = {}  # look the blocks up again next time
            return None
        rows = sum(int(r["rows"]) for r in replies)
        sums: dict[str, float] = {}
        for reply in replies:
            for name, value in reply["sums"].items():
                sums[name] = sums.get(name, 0.0) + float(value)
        self.rows_by_worker = {a: int(r["rows"]) for a, r in zip(self.holders, replies)}
        scores = {name: value / rows for name, value in sums.items()} if rows else {}
        if metrics and rows:
            held = [r for r in replies if "outputs" in r]  # a holder of no rows sends none
            scores.update(extra_metrics(metrics, [r["outputs"] for r in held],
                                        [np.asarray(r["targets"]) for r in held]))
        for name, builtin in (self.config.trains.metrics or {}).items():  # aliases
            if isinstance(builtin, str) and builtin in scores:
                scores[name] = scores[builtin]
        return scores
