"""The private torch and distributed APIs dask-train needs, each in one place, each with the
public API whose absence makes it necessary. ``tests/runtime/test_compat.py`` fails loudly when
one of them changes shape in a new release. (One lives where it is used, below this layer:
``models._torch.without_dynamo``, tested in ``tests/models/test_optimizers.py``.)
"""

from __future__ import annotations

import math
import pickle
import sys
from collections.abc import Callable, MutableMapping
from typing import Any


def worker_data(worker: Any) -> MutableMapping[Any, Any]:
    """The worker's in-memory task results (key -> value).

    Missing public API: distributed has no call that reads a result a worker holds without a
    task (``Worker.data`` is an attribute, described in the Worker docstring but not a stable
    interface; it became a ``SpillBuffer`` in 2021). The feed handler reads a trainer's local
    block from it so a block never moves or costs a task.
    """
    data: MutableMapping[Any, Any] = worker.data
    return data


def room_below_target(worker: Any) -> float:
    """Bytes this worker's process may still grow before Dask's memory target (the fraction of
    its limit at which it starts moving data to disk; 60% by default), infinite without a limit.

    Read from the worker's memory manager and monitor, as Dask's own memory checks do: the
    process's whole memory, managed and unmanaged.
    """
    manager = worker.memory_manager
    limit = manager.memory_limit
    fraction = manager.memory_target_fraction or manager.memory_spill_fraction
    if not limit or not fraction:
        return math.inf
    return float(fraction * limit - worker.monitor.get_process_memory())


def pause_profiler(worker: Any) -> Callable[[], None] | None:
    """Stop the worker's statistical profiler; return what starts it again (None when it was
    not running: turned off in Dask's config, or already stopped).

    Missing public API: the profiler is a periodic callback of the worker, on or off for its
    whole life (``distributed.worker.profile.enabled``, read at its start), with no call to
    pause it; here its ``PeriodicCallback`` in ``Worker.periodic_callbacks["profile"]`` is
    stopped and started on the worker's event loop, where Tornado wants it.
    """
    callback = getattr(worker, "periodic_callbacks", {}).get("profile")
    if callback is None or not callback.is_running():
        return None
    loop = worker.loop
    loop.add_callback(callback.stop)

    def resume() -> None:
        if worker.status.name not in ("closing", "closed", "closing_gracefully", "failed"):
            loop.add_callback(callback.start)

    return resume


#: Seconds a dropped topic's late events are still taken, and ignored (``drop_topic_handler``).
LATE_EVENTS_S = 5.0


def _late_event(event: Any) -> None:
    """Take an event that was on its way when its topic was dropped: nothing to do."""


def drop_topic_handler(client: Any, topic: str) -> None:
    """Forget ``client``'s handler of event ``topic`` after ``unsubscribe_topic``.

    Missing public API: ``Client.unsubscribe_topic`` tells the scheduler but keeps the handler in
    ``Client._event_handlers``, and with it the controller and every future it references, for
    as long as the client lives (found by the throughput benchmark's memory growth). Events the
    scheduler sent before it heard of the unsubscribe still arrive, and distributed answers one
    whose topic has no handler by raising in its stream handler (an ERROR, "No event handler
    known for topic", with a traceback: roles stopped by Ctrl-C log as they end): for
    :data:`LATE_EVENTS_S` seconds a no-op takes them, then the topic is forgotten.
    """
    handlers = getattr(client, "_event_handlers", None)
    if not isinstance(handlers, dict) or topic not in handlers:
        return
    handlers[topic] = _late_event

    def forget() -> None:
        if handlers.get(topic) is _late_event:
            del handlers[topic]

    loop: Any = getattr(client, "loop", None)
    try:
        loop.add_callback(loop.call_later, LATE_EVENTS_S, forget)  # thread-safe, then on the loop
    except Exception:  # no loop to wait on (a closed client): no event arrives any more
        forget()


def forget_topics(topic: str, *, after: float = LATE_EVENTS_S, dask_scheduler: Any = None) -> None:
    """``run_on_scheduler``: forget, ``after`` seconds from now, the scheduler's record of event
    topic ``topic`` and of its generations' (``<topic>-g<n>``), unless someone subscribes to one.

    Missing public API: the scheduler keeps every topic it ever heard of, with its last
    ``distributed.admin.low-level-log-length`` events (1,000 by default), for as long as it
    lives, and a job publishes on two topics or more (its roles' figures each second, its
    scores): a scheduler that runs for months kept them all (two topics and about 60 events
    per one-second fit, measured; 1,000 per topic for a long job). The Training page keeps its
    own view of the latest jobs (``monitor._jobs.Jobs``), so nothing reads them after the job.
    The wait lets events still on their way land first; it looks again three times, later
    (a topic someone still subscribes to is kept while they do).
    """
    import asyncio
    import re

    broker = getattr(dask_scheduler, "_broker", None)
    topics = getattr(broker, "_topics", None)
    if not isinstance(topics, dict):
        return
    mine = re.compile(rf"^{re.escape(topic)}(-g\d+)?$")
    loop = asyncio.get_running_loop()

    def forget(tries: int) -> None:
        kept = False
        for name in [n for n in topics if mine.match(n)]:
            if getattr(topics[name], "subscribers", ()):
                kept = True  # a client's unsubscribe still on its way, or someone watching
            else:
                del topics[name]
        # Again later: for a topic kept by its subscriber, and for events that came late
        # (a worker's last figures, its stream held up on a loaded machine) and made it anew.
        if tries > 1:
            loop.call_later(after * (1 if kept else 5), forget, tries - 1)

    loop.call_later(after, forget, 4)


def reset_torch_group_count() -> None:
    """Reset torch's count of process groups created in this process.

    Missing public API: a failed ``init_process_group`` leaves ``c10d._world.group_count`` raised
    (only destroying a default group resets it), and the count names the group's keys in the
    rendezvous store: a rank that failed once would wait under another name than its peers.
    """
    from torch.distributed import distributed_c10d as c10d

    c10d._world.group_count = 0


#: The name distributed's Nanny gives the worker processes it starts.
DASK_WORKER_PROCESS = "Dask Worker process (from Nanny)"


def start_workers_without_main() -> None:
    """Make the Dask worker processes this process starts skip re-importing its ``__main__``.

    Missing public API: Python's ``spawn`` and ``forkserver`` start methods re-run the parent's
    main script in every child (``multiprocessing.spawn.get_preparation_data`` records its path,
    the child imports it). For a training script that means each embedded worker imports torch
    and whatever the script loads at its top (seconds per worker), and a script without the
    ``if __name__ == "__main__":`` guard starts its cluster again inside each worker and fails
    with "Nanny failed to start". Dask needs nothing from the main module in a worker: functions
    and classes defined there travel by value (cloudpickle), exactly as from a notebook, whose
    main module has no file either. So for Dask's worker processes only (by the name distributed
    gives them), the main module's path and name are left out of the preparation data; every
    other process this program starts is untouched. Idempotent.
    """
    import multiprocessing.spawn as spawn

    original = spawn.get_preparation_data
    if getattr(original, "_dask_train", False):
        return

    def get_preparation_data(name: str) -> dict[str, Any]:
        data: dict[str, Any] = original(name)
        if name == DASK_WORKER_PROCESS:
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    get_preparation_data._dask_train = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


def _dumps_keras(model: Any) -> tuple[dict[str, Any], list[bytes]]:
    return {}, [pickle.dumps(model, protocol=5)]


def _loads_keras(header: dict[str, Any], frames: list[Any]) -> Any:
    return pickle.loads(frames[0])


def fix_keras_serialization() -> None:
    """Make Dask send Keras 3 models pickled, through Keras 3's own ``__reduce__``.

    A bug to work around: distributed registers a "dask" serializer for ``keras.Model`` that calls
    ``model._updated_config()``, a Keras 2 method, so every Keras 3 model sent to a worker
    (scattered, or a task argument) fails with "Could not serialize object of type Sequential".
    Registering ours (public: ``dask_serialize.register``) is not enough. Private parts touched:
    the dispatcher caches the broken function per subclass already seen (``Dispatch._lookup``),
    and distributed's lazy registration (``register_lazy("keras")``, public) would run again when
    keras is first met; both are replaced here. Idempotent; run in the client and in every worker
    (the dask-train plugin does).
    """
    from distributed.protocol import dask_deserialize, dask_serialize

    def register() -> None:
        import keras

        # distributed's own registration first (an import registers it once), then ours over it.
        from distributed.protocol import keras as _distributed_keras  # noqa: F401

        for dispatch, fn in ((dask_serialize, _dumps_keras), (dask_deserialize, _loads_keras)):
            dispatch.register(keras.Model, fn)
            for cls in list(dispatch._lookup):
                if isinstance(cls, type) and issubclass(cls, keras.Model):
                    dispatch._lookup[cls] = fn

    for dispatch in (dask_serialize, dask_deserialize):
        dispatch.register_lazy("keras", register)
    if "keras" in sys.modules:
        register()
