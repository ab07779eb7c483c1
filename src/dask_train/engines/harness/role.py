"""The worker side every trainer role shares: an async-ps trainer and a sync rank are each a
:class:`TrainerRole` plus their own loop.

The harness does what is the same for every role: configure torch in the worker, find the job's
state, leave the worker's thread pool (``secede``: roles sharing a process and the feed tasks must
never wait for a thread), seed or restore the RNG, build the model on the role's device, read the
role's feed, publish the typed events of :mod:`dask_train.engines._events`, pause for checkpoints,
report non-finite losses and stats, and build the result record the engine gathers.
"""

from __future__ import annotations

import base64
import copy
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from distributed import get_worker, secede

from dask_train.data._feed import FeedItem, FeedReader
from dask_train.engines._events import Block, Exit, NonFinite, Paused, Started
from dask_train.engines._spec import RoleConfig
from dask_train.engines.harness.control import close_released_segments
from dask_train.engines.harness.stats import StatsReporter
from dask_train.errors import release_frames
from dask_train.models._transport import unwrap
from dask_train.runtime._compat import room_below_target
from dask_train.runtime._denormals import flushed
from dask_train.runtime._plugin import worker_state

F = TypeVar("F", bound=Callable[..., Any])


def role_task(fn: F) -> F:
    """Mark ``fn`` as a training role's Dask task (a trainer, a rank, the scorer, a ``dt.run``
    rank): while it runs, its worker counts a role running (``WorkerState.role_running``: Dask's
    profiler is paused there meanwhile, as its 10 ms wake-ups slow the roles' steps), and its
    thread and torch's intra-op threads flush denormals (:mod:`dask_train.runtime._denormals`,
    Dask config ``dask-train.flush-denormal``), as they were again once it ends."""

    @functools.wraps(fn)
    def task(*args: Any, **kwargs: Any) -> Any:
        state = worker_state(get_worker())
        # torch's thread count first: the intra-op team the flags are set on is then its own.
        state.configure_torch()
        with state.role_running():
            # Out of the pool before the flags are set: ``secede`` starts the thread that takes
            # this one's place from this thread, and a new thread inherits its FTZ/DAZ flags
            # (the worker's later tasks flushed denormals, seen by tests/runtime/test_denormals.py).
            leave_pool()
            try:
                with flushed():
                    return fn(*args, **kwargs)
            except BaseException as exc:
                # Dask keeps a failed task's error until the task is released; its frames held
                # the role's tensors (views of a shared-memory segment among them) until Python's
                # cycle collector ran. Its traceback still names every file and line.
                release_frames(exc)
                raise
            finally:
                # A failing role closed its segment inside the error's frames, whose views kept
                # the mapping; they are cleared only here, possibly after the job was dropped on
                # this worker (another role's failure ended it first).
                close_released_segments()

    return task  # type: ignore[return-value]


def leave_pool() -> None:
    """``secede`` from the worker's thread pool, once (a role's task calls it at its start; a
    second call does nothing): roles sharing a process and the feed tasks must never wait for a
    thread."""
    from distributed.threadpoolexecutor import thread_state

    if getattr(thread_state, "proceed", False):  # True in a pool thread that has not seceded
        secede()


class TrainerRole:
    """One trainer role on its worker (call from the role's Dask task, before anything else).

    Parameters
    ----------
    job : str
        The generation's key on the workers.
    index : int
        The trainer's index (a sync job's rank).
    config : RoleConfig
    kind : str
        How the role names itself in errors ("trainer" or "rank").

    Examples
    --------
    Inside a role's task::

        role = TrainerRole(job=job, index=index, config=config, kind="rank")
        model = role.model(module)
        cursor = BlockCursor(role)
        ...
        cursor.close_block(steps=steps)  # role.block(epoch, block, rows=..., done=..., steps=...)
        role.exit(steps=steps)
        return role.result(steps=steps, samples=samples, allreduce_s=comm_s)
    """

    def __init__(self, *, job: str, index: int, config: RoleConfig, kind: str = "trainer") -> None:
        self.worker = get_worker()
        worker_state(self.worker).configure_torch()
        self.state = worker_state(self.worker).job(job)
        leave_pool()
        self.job, self.index, self.config = job, index, config
        self.name = f"{kind}-{index} on {self.worker.address}" if kind == "trainer" \
            else f"{kind} {index} on {self.worker.address}"
        seed_trainer(seed=config.seed, index=index, saved=config.rng)
        self.pauser = Pauser(self.worker, self.state, topic=config.topic, trainer=index,
                             timeout=config.timeout)
        self.nans = NanReporter(self.worker, topic=config.topic, trainer=index)
        self.started_at = time.perf_counter()
        self._started_sent = False
        self.reader: FeedReader | None = None

    @property
    def address(self) -> str:
        """The worker's address."""
        return str(self.worker.address)

    def model(self, module: Any, device: str | None = None) -> Any:
        """The role's model adapter: a copy of ``module`` on its device, in the job's precision."""
        return model_for(module, self.address, self.config, device)

    def feed(self, on_idle: Callable[[], None] | None = None) -> FeedReader:
        """The reader of this trainer's feed queue (blocks granted by the engine)."""
        self.reader = FeedReader(self.state.feed(self.index), self.state.stop,
                                 timeout=self.config.timeout, role=self.name, on_idle=on_idle)
        return self.reader

    def stats(self, start: dict[str, float] | None = None) -> StatsReporter:
        """A reporter of this trainer's last second (``start``: totals already counted)."""
        return StatsReporter(self.worker, topic=self.config.topic, role="trainer",
                             index=self.index, start=start, extra=self.memory)

    def memory(self) -> dict[str, Any]:
        """This trainer's memory as its stats reports carry it: the worker's memory limit, and
        the blocks it holds and its read time (:meth:`~dask_train.data.FeedReader.stats`)."""
        figures: dict[str, Any] = {"memory_limit": int(self.worker.memory_manager.memory_limit or 0)}
        if self.reader is not None:
            figures.update(self.reader.stats(), held_bytes=self.reader.held)
        return figures

    def stopped(self) -> bool:
        """True once the controller asked the job to stop."""
        return bool(self.state.stop.is_set())

    # -- events -----------------------------------------------------------------------------------
    def started(self) -> None:
        """Start-up ended: the first step is on its way (sent once)."""
        if not self._started_sent:
            self._started_sent = True
            self.worker.log_event(self.config.topic, Started(trainer=self.index).message())

    def block(self, epoch: int, block: int, *, rows: int, done: bool, steps: int) -> None:
        """``rows`` rows of a block were trained on (``done``: the block is finished); says
        whether the trainer was starved of blocks and its worker can hold one more."""
        reader = self.reader
        # Two blocks' room: the one granted and the one being read into before the last is freed.
        starved = reader is not None and reader.take_starved() and \
            room_below_target(self.worker) > 2 * reader.block_bytes
        self.worker.log_event(self.config.topic, Block(
            trainer=self.index, epoch=int(epoch), block=int(block), rows=int(rows),
            done=bool(done), steps=int(steps), starved=starved).message())

    def exit(self, *, steps: int) -> None:
        """The last event: once the controller has it, it has every block report sent before."""
        self.worker.log_event(self.config.topic, Exit(trainer=self.index, steps=int(steps)).message())

    def result(self, *, steps: int, samples: int, **timings: Any) -> dict[str, Any]:
        """The record the engine gathers: where the trainer's time went (``timings``), so a slow
        job says whether it waited for data, servers or collectives, and its memory: the
        worker's limit and the bytes of blocks it held (``FeedReader.stats``)."""
        return {"trainer": self.index, "steps": int(steps), "samples": int(samples),
                "worker": self.address, "busy_s": time.perf_counter() - self.started_at,
                **timings, "nonfinite": self.nans.count, "rng": rng_state(),
                **self.memory()}


class BlockCursor:
    """Where a trainer is in its feed: the block being read and its rows handed out so far,
    reported to the controller (:meth:`TrainerRole.block`) once the trainer leaves the block.

    The one reader of a role's blocks: a sync rank's batches, ``dt.run``'s ``ctx.batches``
    and an async-ps trainer's loop each cut batches their own way, and each moves the cursor
    with :meth:`take`. ``consumed`` counts from the block's ``skip``: rows applied before a
    resume count as consumed, so :meth:`position` is what a checkpoint records.

    Parameters
    ----------
    role : TrainerRole
        Whose feed is read (:meth:`TrainerRole.feed`) and who reports the blocks.
    on_idle : callable, optional
        Called while the feed waits for a block (:class:`~dask_train.data.FeedReader`).

    Examples
    --------
    ::

        cursor = BlockCursor(role)
        while (item := cursor.next_block()) is not None:
            for x, y, w in batches(item, batch_size):
                ...  # train on the batch
                cursor.take(len(y))
            cursor.close_block(steps=steps)
    """

    def __init__(self, role: TrainerRole, on_idle: Callable[[], None] | None = None) -> None:
        self.role = role
        self.reader = role.feed(on_idle)
        self.item: FeedItem | None = None  # the block being read
        self.consumed = 0  # its rows handed out, those a resume skipped included
        self.samples = 0  # rows handed out over every block (none skipped)
        self.batches = 0  # batches handed out over every block
        self.ahead: FeedItem | None = None  # a later epoch's first block, read too early
        self.ended = False  # the end marker came (or the job stopped)

    def next_block(self, upto: int | None = None) -> FeedItem | None:
        """Move to the next block and return it; None once the feed has ended, or (``upto``
        given) once the blocks of epoch ``upto`` and earlier are read: a block of a later epoch
        waits for its turn."""
        item: FeedItem | None
        if self.ahead is not None:
            if upto is not None and self.ahead.epoch > upto:
                return None
            item, self.ahead = self.ahead, None
        elif self.ended:
            return None
        else:
            item = self.reader.next()
        if item is None or item.x is None:
            self.ended = True
            return None
        if upto is not None and item.epoch > upto:
            self.ahead = item
            return None
        # Rows skipped after a resume count as consumed: they were applied before it.
        self.item, self.consumed = item, item.skip
        return item

    def take(self, rows: int) -> None:
        """A batch of ``rows`` rows of the current block was handed out."""
        self.consumed += rows
        self.samples += rows
        self.batches += 1

    def position(self) -> list[int] | None:
        """[epoch, block, rows consumed] of the block being read, None between blocks."""
        return None if self.item is None else [self.item.epoch, self.item.block, self.consumed]

    def close_block(self, *, steps: int) -> None:
        """Report the block being read (in full or in part) with the role's ``steps`` so far,
        and forget it."""
        item = self.item
        if item is not None:
            self.role.block(item.epoch, item.block, rows=self.consumed - item.skip,
                            done=self.consumed == item.rows, steps=steps)
        self.item = None


def model_for(module: Any, address: str, config: RoleConfig, device: str | None = None) -> Any:
    """The model adapter a role on ``address`` trains or scores with: a copy of ``module`` on the
    device the controller chose for that worker (or ``device``), in the job's precision."""
    from dask_train.models._flat import flat_model

    return flat_model(copy.deepcopy(unwrap(module)), device=device or config.device_for(address),
                      precision=config.precision)


def rng_state() -> str:
    """This process's torch RNG state as text (it travels in an event and a JSON manifest)."""
    import torch

    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii")


def set_rng_state(text: str) -> None:
    """Restore a state from :func:`rng_state`."""
    import torch

    raw = bytearray(base64.b64decode(text))
    torch.set_rng_state(torch.frombuffer(raw, dtype=torch.uint8).clone())


def seed_trainer(*, seed: int, index: int, saved: Mapping[str, str] | None) -> None:
    """Seed torch's RNG (dropout, random layers) per trainer, or restore a checkpointed state.

    Seeding makes a run reproducible from its seed; restoring makes a resumed run continue the
    uninterrupted one's random stream.
    """
    import torch

    text = (saved or {}).get(str(index))
    if text:
        set_rng_state(text)
    else:
        torch.manual_seed(int(seed) * 1_000_003 + index)


class Pauser:
    """A trainer's side of checkpoint pauses.

    Parameters
    ----------
    worker : distributed.Worker
    state : WorkerJob
        The job's state on this worker (pause and resume ids live there).
    topic : str
        The job's event topic.
    trainer : int
    timeout : float
        Longest wait for the controller to resume.
    """

    def __init__(self, worker: Any, state: Any, *, topic: str, trainer: int, timeout: float) -> None:
        self.worker, self.state, self.topic = worker, state, topic
        self.trainer, self.timeout = trainer, timeout
        self.handled = 0

    def requested(self) -> bool:
        """True when the controller asked for a pause this trainer has not taken yet."""
        return bool(self.state.pause_id > self.handled)

    def pause(self, position: list[int] | None, *, steps: int, pause_id: int | None = None) -> bool:
        """Report ``position`` ([epoch, block, rows] or None between blocks) and wait.

        Returns False when the job was stopped while paused.
        """
        self.handled = int(pause_id if pause_id is not None else self.state.pause_id)
        self.worker.log_event(self.topic, Paused(
            trainer=self.trainer, id=self.handled, steps=steps, position=position,
            rng=rng_state()).message())
        return bool(self.state.wait_resume(self.handled, timeout=self.timeout))


class NanReporter:
    """Reports non-finite losses to the controller: the first few in full, then a count."""

    def __init__(self, worker: Any, *, topic: str, trainer: int, limit: int = 5) -> None:
        self.worker, self.topic, self.trainer, self.limit = worker, topic, trainer, limit
        self.count = 0

    def report(self, *, loss: float, step: int, epoch: int, block: int) -> None:
        """Publish one non-finite loss (silently counted after ``limit`` reports)."""
        self.count += 1
        if self.count <= self.limit:
            self.worker.log_event(self.topic, NonFinite(
                trainer=self.trainer, loss=str(loss), step=step, epoch=epoch, block=block,
                count=self.count).message())
