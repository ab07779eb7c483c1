"""Flush-to-zero and denormals-are-zero where dask-train computes (Dask config
``dask-train.flush-denormal``, default True).

Why: float32 values below 2**-126 (about 1.18e-38) are *denormal*; an x86 core computes with them
through a slow microcode path, many times slower per operation, and values decaying towards
zero make them (an optimizer's moments of an element whose gradient has become zero: Adam's
first moment decays by ``beta1=0.9`` a step, from 1e-3 to below 1.18e-38 in about 770 steps).
``torch.set_flush_denormal(True)`` sets the core's FTZ and DAZ flags (results and inputs below
2**-126 become 0), which removed a 40% slow-down of async-ps on the MLP 64-1024-1024-10 after
20 s of training (docs/training.md).

The flags are per thread (the MXCSR register), and torch's intra-op threads are separate threads:
with OpenMP (torch's CPU wheels), each thread that starts parallel work owns a team of threads of
its own, made when it first ran parallel work, and a flag set on the calling thread later does not
reach them (measured: half of a 4M-element product stayed denormal on 2 threads). So
:func:`flushed` sets the flags on the calling thread *and* on every thread of its OpenMP team, by
running a tiny function on each through libgomp's ``GOMP_parallel`` (the entry point
``#pragma omp parallel`` compiles to; the team's threads are reused in order, so they are the ones
torch's kernels run on), and puts back each thread's earlier state when the block ends: a worker's
other tasks see the flags as they were.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

#: The Dask config key that turns the flags off (``dask-train.flush-denormal: false``).
CONFIG_KEY = "dask-train.flush-denormal"

#: The smallest normal float32: a result below it becomes 0 with the flags on.
FLOAT32_TINY = 1.1754943508222875e-38

_local = threading.local()
_gomp_lock = threading.Lock()
_gomp: Any = None  # the libgomp torch runs on, False where there is none (see _team_call)
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
T = TypeVar("T")


def enabled() -> bool:
    """Whether roles flush denormals here (Dask config ``dask-train.flush-denormal``, default
    True; read on the worker, as ``dask-train.host-memory`` is)."""
    import dask

    value = dask.config.get(CONFIG_KEY, True)
    if isinstance(value, str):  # DASK_DASK_TRAIN__FLUSH_DENORMAL=false arrives as text in places
        return value.strip().lower() not in ("false", "0", "no", "off")
    return bool(value)


def flushing() -> bool:
    """Whether the calling thread flushes denormals now (FTZ/DAZ on): torch has no getter, so
    a denormal float32 is multiplied by one on this thread (one element: no intra-op thread)."""
    import torch

    return bool((torch.tensor([1e-40], dtype=torch.float32) * 1.0).item() == 0.0)


def set_flush(on: bool) -> None:
    """Set FTZ/DAZ on the calling thread only (``torch.set_flush_denormal``)."""
    import torch

    torch.set_flush_denormal(bool(on))


def _load_gomp() -> Any:
    """libgomp as torch loaded it, or False when torch's intra-op threads are not OpenMP's."""
    global _gomp
    with _gomp_lock:
        if _gomp is None:
            _gomp = False
            try:
                import torch

                if "OpenMP" in torch.__config__.parallel_info():
                    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
                    # dlopen of a library already loaded (torch's own) returns that library.
                    lib = ctypes.CDLL(path if os.path.exists(path) else "libgomp.so.1")
                    lib.GOMP_parallel.argtypes = [_CALLBACK, ctypes.c_void_p, ctypes.c_uint,
                                                  ctypes.c_uint]
                    lib.GOMP_parallel.restype = None
                    lib.omp_get_thread_num.restype = ctypes.c_int
                    _gomp = lib
            except (OSError, AttributeError):
                logger.debug("no libgomp to reach torch's intra-op threads", exc_info=True)
    return _gomp


def _team_call(fn: Callable[[int], None]) -> bool:
    """Run ``fn(thread number)`` once on each thread of the calling thread's OpenMP team (the
    calling thread is number 0); False where torch's intra-op threads cannot be reached."""
    gomp = _load_gomp()
    if not gomp:
        return False
    import torch

    threads = int(torch.get_num_threads())
    if threads <= 1:
        fn(0)
        return True
    errors: list[BaseException] = []

    def each(_: Any) -> None:
        try:
            fn(int(gomp.omp_get_thread_num()))
        except BaseException as error:  # an exception must not unwind through C
            errors.append(error)

    callback = _CALLBACK(each)
    gomp.GOMP_parallel(callback, None, threads, 0)  # ctypes releases the GIL meanwhile
    if errors:
        raise errors[0]
    return True


@contextlib.contextmanager
def flushed(on: bool | None = None) -> Iterator[bool]:
    """Flush denormals (FTZ/DAZ) on this thread and its intra-op threads inside the block.

    Parameters
    ----------
    on : bool or None
        True sets the flags, False clears them; None (the default) reads the Dask config
        ``dask-train.flush-denormal`` (default True) and leaves everything as it is when it is
        off.

    Yields whether the block flushes. Nested blocks on one thread cost nothing; the outermost
    restores every thread's earlier state.

    Examples
    --------
    >>> import torch
    >>> with flushed(True):
    ...     (torch.tensor([1e-40]) * 1.0).item()
    0.0
    """
    want = enabled() if on is None else bool(on)
    depth = getattr(_local, "depth", 0)
    if on is None and not want and depth == 0:
        yield False
        return
    if depth and getattr(_local, "on", None) == want:
        _local.depth = depth + 1
        try:
            yield want
        finally:
            _local.depth -= 1
        return
    before: dict[int, bool] = {}

    def enter(number: int) -> None:
        before[number] = flushing()
        set_flush(want)

    if not _team_call(enter):
        enter(0)
    outer = getattr(_local, "on", None)
    _local.depth, _local.on = depth + 1, want
    try:
        yield want
    finally:
        _local.depth, _local.on = depth, outer

        def leave(number: int) -> None:
            # A thread the team gained meanwhile was made from this one: it gets this one's state.
            set_flush(before.get(number, before.get(0, False)))

        if not _team_call(leave):
            leave(0)


def call_flushed(fn: Callable[..., T], /, *args: Any) -> T:
    """``fn(*args)`` with denormals flushed as the Dask config says, for work that runs briefly
    on a shared thread: a parameter server's update on the worker's event loop or on its shard's
    own thread.

    Only the calling thread's flags are set for the call and put back after it (a few
    microseconds; a full set and restore of the OpenMP team costs ~90 us, as much as a small
    shard's whole update, and ``GOMP_parallel`` from the event loop of a forked worker hung a
    test). A shard's own thread makes its team at its first parallel step, inside this call, so
    the team's threads inherit the flags; the event loop's team keeps the state it was made with.
    """
    if not enabled():
        return fn(*args)
    before = flushing()
    set_flush(True)
    try:
        return fn(*args)
    finally:
        set_flush(before)
