"""``Trainer``: the user's entry point for training a torch module on a Dask cluster."""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from distributed import Client

from dask_train.api._build import float_dtype
from dask_train.api._data import materialize
from dask_train.api._fit import check_plan, fit_torch
from dask_train.api._fit_array import fit_array
from dask_train.api._model import build_from, is_factory
from dask_train.api._plan import FitPlan
from dask_train.api._result import FitResult
from dask_train.api._settings import Settings
from dask_train.checkpoint import CheckpointConfig
from dask_train.data._training import TrainingData
from dask_train.errors import InvalidInput, release_frames
from dask_train.models._array import ArrayModel
from dask_train.policy._failure import FailureConfig
from dask_train.policy._settings import ClusterSettings, DataSettings
from dask_train.policy.callbacks import Callback
from dask_train.policy.stop import StopCondition
from dask_train.runtime._connect import default_client
from dask_train.runtime._versions import check_once

logger = logging.getLogger(__name__)


class Trainer:
    """Train a model on a Dask cluster: asynchronous parameter servers, synchronous data
    parallelism, or whichever of them (or one process) is measured fastest.

    Parameters
    ----------
    module : torch.nn.Module or callable
        The model; it is copied, never modified in place. ``fit`` returns the trained copy. Any
        module whose ``state_dict()`` round-trips trains: recurrent layers, tied weights, frozen
        layers. Or a function building it (``Trainer(make_net)``): the way for a model that cannot
        be pickled (``weight_norm`` and other parametrizations); every worker builds its own and
        loads the client's initial values.
    loss : {"cross_entropy", "nll", "mse", "l1"}, torch.nn.Module or callable
        A name, a loss module such as ``torch.nn.CrossEntropyLoss(label_smoothing=0.1)``, or a
        function ``fn(output, target) -> scalar tensor`` (a batch mean). Scores report
        ``accuracy`` for the classification losses (the names ``cross_entropy``/``nll``,
        ``CrossEntropyLoss``/``NLLLoss`` modules).
    metrics : dict, optional
        Extra scores, by name: a built-in name (``"accuracy"``, ``"loss"``), a function
        ``fn(output, target) -> number`` over the whole validation set, or an object with
        ``reset``/``update``/``compute`` such as a torchmetrics metric. Stop conditions and
        callbacks may watch any of them.
    optimizer : {"adam", "sgd", "adamw", "rmsprop", "adagrad"} or torch.optim.Optimizer subclass
        A name or a class such as ``torch.optim.SGD`` (with ``optimizer_options``). It must
        update each parameter element by element (as these do): servers hold flat slices.
        Applied on the parameter servers, which hold its state.
    lr : float
        Learning rate.
    optimizer_options : mapping, optional
        Extra optimizer arguments, e.g. ``{"momentum": 0.9}`` for SGD.
    strategy : {"async-ps", "sync", "auto"}
        ``"async-ps"``: asynchronous parameter servers. ``"sync"``: synchronous data-parallel
        training, one rank per Dask worker in a torch process group (gloo) started by
        :func:`dask_train.start_torch`; every step applies the mean gradient of all ranks'
        batches. ``ps`` and ``prefetch`` do not apply to it. ``"auto"``: the job's costs are
        measured on the cluster at fit time and the fastest of async-ps, sync and one process
        on one worker (sync with one rank) is run; the choice and every candidate's predicted
        samples/s are logged and in ``result.plan`` (see ``dask_train.policy._strategy``).
    ps : int or "auto"
        Parameter servers; the flat parameters are split into this many balanced shards.
        ``"auto"``: chosen at fit time by the cost model from the job's costs measured on the
        cluster (a gradient, an optimizer step, an echo between two workers); the choice and its
        predicted rate are logged (see ``dask_train.policy.CostModel``).
    workers : int, (int, int) or None
        Trainers. Each reads the blocks that live on its Dask worker first. ``(least, most)``:
        the job starts with as many trainers as the cluster has workers within the bounds
        (refused when a sync job's cluster has fewer than ``least``) and gives a worker that
        joins a trainer up to ``most`` (a sync job regroups onto it at its next step); None:
        every worker, now and as they join. A range takes ``batch_size`` (per trainer), not
        ``global_batch_size``, and a strategy other than ``"auto"``.
    scorer : {0, 1}
        A scorer evaluates ``validation`` every ``score_every`` seconds (needs ``validation``).
    batch_size : int
        Rows per batch of each trainer. A ``sync`` step averages the gradients of every
        trainer's batch, so it sees ``workers * batch_size`` rows; in ``async-ps`` each push is
        one trainer's batch (times ``grad_accumulation``).
    global_batch_size : int, optional
        The rows of one step over all trainers, instead of ``batch_size``: each trainer then
        takes ``global_batch_size // workers`` (it must divide evenly). The same global batch
        gives the same per-step statistics whatever the number of trainers.
    epochs : int
        Passes over the data; the job ends after the last unless a stop condition fires first.
    stop : sequence of StopCondition
        ``StopAtScore``, ``StopAtStep``, ``StopAfter``, ``EarlyStopping``; the first to fire wins.
    callbacks : sequence of Callback
    score_every : float
        Seconds between scores.
    scorer_budget : "auto", float or None
        The share of one core the scorer may spend scoring, over the job: a score that would
        exceed it is skipped (the next is spaced out) rather than slow the trainers. ``"auto"``
        is ``1 / (trainers + 1)``; None scores every ``score_every`` whatever it costs.
        ``result.scorer`` says what it spent and skipped.
    shuffle : bool
        Shuffle block order and rows within blocks, per epoch, seeded by ``seed``.
    seed : int
    prefetch : "auto", int or bool
        Pushes a trainer keeps in flight while it computes the next gradients: each overlaps
        communication with computation at one update of extra staleness. ``True`` (default) is
        1, ``False`` or 0 a plain sequential loop (exactly a single-process loop with one
        trainer). ``"auto"`` adapts between 1 and 4 to keep the trainer's wait for the servers
        under about 15%: more samples per second for small models (whose gradient takes less
        time than a round trip), but each push more is one update more of staleness, which
        slows or spoils convergence with momentum or high learning rates (SGD with Nesterov
        momentum 0.9 fell from 0.9 to 0.46 accuracy in one test), so it is not the default.
    grad_accumulation : int
        Average the gradients of this many batches into one push and one server update: k times
        fewer messages and optimizer steps, at an effective batch of ``k * batch_size``. Steps
        (``StopAtStep``, ``result.steps``) count server updates.
    blocks_ahead : int or "auto"
        Blocks granted to each trainer ahead of the one it reads: the bound of its feed queue.
        ``"auto"`` (the default) grants two; for streamed data, a trainer that waited for a
        block is granted one more (up to eight) while its worker has room for it below Dask's
        memory target, so reads hide behind training even for small blocks or slow storage.
    timeout : float
        Seconds any single wait may take (a role starting, data arriving, a reply) before the job
        fails with :class:`~dask_train.errors.TrainingTimeout` instead of hanging.
    progress : bool
        Show a progress bar with the live score.
    checkpoint : CheckpointConfig, str or os.PathLike, optional
        A directory or fsspec URL (``"runs/x"``: ``CheckpointConfig("runs/x")``, every 30 s,
        keep 3), or a :class:`~dask_train.CheckpointConfig`: where and how often to checkpoint
        (parameters, optimizer state, data position, RNG and stop-condition state). The path
        must be reachable from every worker that holds a parameter server (sync: rank 0), e.g.
        a shared file system or an object store URL. A final checkpoint is written when the
        job stops. Needed by ``fit(resume=True)`` and to survive losing a parameter server or a
        sync rank.
    failure : FailureConfig, optional
        How many lost or failed roles the job survives (default ``FailureConfig(max_failures=3)``):
        a lost async trainer's rows go to the survivors, a lost scorer is replaced, a lost
        parameter server or sync rank restarts the job from the newest checkpoint on the live
        workers. One failure more ends the job with ``WorkerLost`` / ``ParameterServerLost``.
    on_nan : {"stop", "skip"}
        A non-finite loss or score: ``"stop"`` ends the job (the last good checkpoint is kept,
        none is written after it); ``"skip"`` leaves that batch out of the update, or that score
        out of the history, and goes on. Either way ``result.nonfinite`` lists them. A job that
        made no finite step at all (its first loss was not finite; with ``"skip"``, every one)
        raises :class:`~dask_train.NonFiniteLoss` naming the step, the trainer and the block.
    device : {"auto", "cpu", "cuda"} or "cuda:N"
        Where trainers and the scorer compute. ``"auto"``: one GPU per Dask worker when every
        worker has one (dask-cuda's ``LocalCUDACluster`` is the convention; workers sharing a
        multi-GPU host take one each), else the CPU. With GPUs, ``sync`` reduces over NCCL;
        async-ps servers keep the parameters and optimizer state in host memory.
    mixed_precision : bool or {"bf16", "fp16"}
        Autocast the forward pass: ``True`` is bfloat16 where the device supports it (CPUs and
        recent GPUs), else float16 with dynamic loss scaling. Parameters, gradients and the
        optimizer stay float32.
    resources : dict, optional
        Dask worker resources each trainer (async-ps) or rank (sync) holds, ``{"GPU": 1}``, as
        ``dask worker --resources GPU=1`` declares them (dask-cuda's and dask-jobqueue's
        convention): trainers run only on workers that declare them, as many on one worker as
        its amount holds (one rank a worker for sync), and each trainer's task holds them while
        it runs, so two jobs never share one GPU worker. A lost trainer's worker is replaced,
        and a joining worker taken, only when it declares them. Parameter servers and the
        scorer hold none and go where placement puts them, the least-loaded workers: those
        without trainers when the cluster has any (a server applies updates in host memory and
        needs no GPU; beside the trainers it would take their workers' CPU and memory), else
        beside them. The data's tasks go where Dask puts them. Refused before any work, naming
        the resource and the workers that have it, when fewer trainers than ``workers`` (its
        least) fit on them, or when other tasks hold them now.
    client : distributed.Client, optional
        Defaults to the current client, or an embedded cluster from :func:`dask_train.connect`.

    Examples
    --------
    >>> net = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))
    >>> trainer = Trainer(net, lr=1e-3, ps=1, workers=2, stop=[StopAtScore("accuracy", 0.95)])
    >>> result = trainer.fit(X, y, validation=(Xv, yv))        # doctest: +SKIP
    >>> result.history.tail(1)                                  # doctest: +SKIP
    """

    def __init__(
        self,
        module: torch.nn.Module | Callable[[], torch.nn.Module],
        *,
        loss: Any = "cross_entropy",
        metrics: Mapping[str, Any] | None = None,
        optimizer: Any = "adam",
        lr: float = 1e-3,
        optimizer_options: Mapping[str, Any] | None = None,
        strategy: str = "async-ps",
        ps: int | str = 1,
        workers: int | tuple[int, int] | None = 2,
        scorer: int = 1,
        batch_size: int = 128,
        global_batch_size: int | None = None,
        epochs: int = 1,
        stop: Sequence[StopCondition] | StopCondition | None = None,
        callbacks: Sequence[Callback] | None = None,
        score_every: float = 1.0,
        scorer_budget: float | str | None = "auto",
        shuffle: bool = True,
        seed: int = 0,
        prefetch: int | bool | str = True,
        grad_accumulation: int = 1,
        blocks_ahead: int | str = "auto",
        timeout: float = 60.0,
        progress: bool = True,
        checkpoint: CheckpointConfig | str | os.PathLike[str] | None = None,
        failure: FailureConfig | None = None,
        on_nan: str = "stop",
        device: str = "auto",
        mixed_precision: bool | str = False,
        resources: Mapping[str, float] | None = None,
        client: Client | None = None,
    ) -> None:
        self.module = module
        self.loss = loss
        self.metrics = metrics
        self.optimizer = optimizer
        self.lr = lr
        self.optimizer_options = dict(optimizer_options or {})
        self.strategy = strategy
        self.ps = ps
        self.workers = workers
        self.scorer = scorer
        self.batch_size = batch_size
        self.global_batch_size = global_batch_size
        self.epochs = epochs
        self.stop = [stop] if isinstance(stop, StopCondition) else list(stop or [])
        self.callbacks = list(callbacks or [])
        self.score_every = score_every
        self.scorer_budget = scorer_budget
        self.shuffle = shuffle
        self.seed = seed
        self.prefetch = prefetch
        self.grad_accumulation = grad_accumulation
        self.blocks_ahead = blocks_ahead
        self.timeout = timeout
        self.progress = progress
        self.checkpoint = checkpoint
        self.failure = failure
        self.on_nan = on_nan
        self.device = device
        self.mixed_precision = mixed_precision
        self.resources = resources
        self.client = client
        # What this Trainer keeps between fits (never a fit's plan): the last fit's model, for
        # warm_start, and its trainers; the model a factory built, once per factory.
        self._last_model: Any = None
        self._last_trainers: int | None = None
        self._built: tuple[Any, Any] | None = None

    def per_trainer_batch(self) -> int:
        """Rows per batch of each trainer: ``batch_size``, or ``global_batch_size / workers``
        (with ``strategy="auto"``, over the trainers the last fit chose)."""
        trainers = self._last_trainers if self._last_trainers is not None else \
            ClusterSettings(self.workers).bounds(0)[0]  # a range takes batch_size: any count
        return DataSettings(self.batch_size, self.global_batch_size).per_trainer_batch(trainers)

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """Hyper-parameters by name, as scikit-learn estimators report them."""
        return {name: getattr(self, name) for name in Settings.names()}

    def set_params(self, **params: Any) -> Trainer:
        """Set hyper-parameters by name; unknown names raise :class:`InvalidInput`."""
        known = self.get_params()
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise InvalidInput(
                [f"{name}= is not a Trainer parameter: use one of {sorted(known)}." for name in unknown]
            )
        for name, value in params.items():
            setattr(self, name, value)
        return self

    def fit(
        self, X: Any, y: Any, validation: tuple[Any, Any] | None = None, *, resume: bool = False,
        warm_start: bool = False, sample_weight: Any = None, data: str = "auto",
    ) -> FitResult:
        """Train on ``(X, y)``; score on ``validation``; return a :class:`FitResult`.

        Parameters
        ----------
        X : dask.array.Array, dask.dataframe.DataFrame or xarray object
            Training inputs, rows are samples. In-memory arrays are wrapped in dask arrays. An
            xarray DataArray or Dataset (``xr.open_zarr(url)``) is cut into rows along the
            sample dimension (``y``'s, else its first); its other dimensions are flattened into
            features and a Dataset's variables are stacked side by side.
        y : dask.array.Array or dask.dataframe.Series
            Labels (classification) or targets, one per row of X.
        validation : (array, array), optional
            Held-out data the scorer evaluates; required for score-based stop conditions.
        resume : bool
            Continue from the newest complete checkpoint under ``checkpoint.path`` (parameters,
            optimizer state, data position, RNG and stop state, history). With none there yet,
            training starts from the module. Needs ``checkpoint=``.
        warm_start : bool
            Start from the model the previous ``fit`` of this Trainer returned (parameters and
            buffers) instead of ``module``; the first fit starts from ``module`` either way.
        sample_weight : array, optional
            One non-negative weight per row of X, applied through the loss: a batch's loss is
            ``sum(weight_i * loss_i) / rows`` (per-sample losses from ``reduction="none"``, or
            from a loss function taking ``(output, target, weight)``). Class weights go in the
            loss itself, e.g. ``torch.nn.CrossEntropyLoss(weight=...)``.
        data : {"auto", "persist", "stream"}
            ``"persist"`` keeps ``X, y`` on the workers for the whole fit; ``"stream"`` reads
            each block from its graph (a zarr, npy or parquet reader) on the worker of the
            trainer that reads it, every epoch, ``blocks_ahead`` at a time, and frees it after
            use: memory stays bounded for data larger than the cluster's. ``"auto"`` persists
            data that fits in half of the workers' summed memory limits and streams the rest,
            and logs its choice with the numbers. In-memory arrays are always sent in blocks.

        Raises
        ------
        InvalidInput
            Every problem with the arguments and data at once, before any training starts.
        NonFiniteLoss
            The job ended without one finite step (e.g. X holds NaN): nothing was trained.
        """
        plan = self._new_plan()
        data_ = TrainingData.of(X, y, sample_weight=sample_weight)
        try:
            if isinstance(plan.model, ArrayModel):
                result = fit_array(plan, data_, materialize(validation, dtype=np.float64),
                                   resume=resume, start=self._start_model(plan, warm_start),
                                   mode=data, client=lambda: self._client(plan))
            else:
                result = fit_torch(plan, data_, validation, resume=resume,
                                   start=self._start_model(plan, warm_start), mode=data,
                                   client=lambda: self._client(plan))
        except BaseException as exc:
            # The frames below here hold the job's data and futures: a failed fit must not
            # keep them (on the scheduler, on the workers) until Python's cycle collector runs.
            release_frames(exc)
            raise
        self._last_model = result.model
        self._last_trainers = int(result.plan.get("workers", plan.trainers))
        return result

    def check(self, X: Any, y: Any, validation: tuple[Any, Any] | None = None, *,
              resume: bool = False, sample_weight: Any = None, data: str = "auto") -> None:
        """Check a ``fit`` of these arguments without running it: no task is submitted.

        Raises
        ------
        InvalidInput
            Every problem with the parameters and the data at once, as ``fit`` would.
        """
        plan = self._new_plan()
        data_ = TrainingData.of(X, y, sample_weight=sample_weight)
        dtype = np.float64 if isinstance(plan.model, ArrayModel) else float_dtype(plan.model)
        check_plan(plan, data_, materialize(validation, dtype=dtype, keep_dask=True),
                   resume=resume, mode=data)

    def _new_plan(self) -> FitPlan:
        """This fit's plan: the parameters now, the model they train (a factory's built once)."""
        factory = self.module if is_factory(self.module) else None
        return FitPlan.of(self.get_params(), model=self._model(), factory=factory)

    def _client(self, plan: FitPlan) -> Client:
        """The client given, else :func:`~dask_train.runtime.default_client`: the current one, or
        an embedded cluster started once (it is the current client from then on, so the next fit
        finds it). ``fit`` never changes ``self.client`` (a hyper-parameter, as in get_params)."""
        if self.client is not None:
            return check_once(self.client)  # its scheduler and workers, before anything runs
        t = time.time()
        client = default_client()
        plan.took("connect", t)
        return client

    def _model(self) -> Any:
        """The model this fit trains: ``module``, or what the factory builds (once per factory)."""
        if not is_factory(self.module):
            return self.module
        if self._built is None or self._built[0] is not self.module:
            self._built = (self.module, build_from(self.module, seed=self.seed))
        return self._built[1]

    def _start_model(self, plan: FitPlan, warm_start: bool) -> Any:
        """What a fit starts from: a copy of its model, or of the last fit's model."""
        last = self._last_model
        return copy.deepcopy(last if warm_start and last is not None else plan.model)
