"""Imported last by the embedded cluster's fork server (see :mod:`dask_train.runtime._fork`).

Its import freezes the objects the server's imports made (``gc.freeze``): the garbage collector
no longer walks them, neither in the server nor in the workers forked from it, which inherit them
(Python's advice for a fork server, so that the collector does not touch, and copy, every page the
workers share with it). Without it the server spent 0.4 s of CPU in its interpreter's final
collection after the program had ended, torch's modules and all.

It also has each forked worker run its ``atexit`` handlers as it ends, as a spawned worker (Dask's
default) does. A process forked by multiprocessing ends with ``os._exit`` after its target
returns, which skips them: what a worker's libraries clean up at exit stayed behind for good
(TensorFlow's AutoGraph writes the code it converts to ``/tmp/__autograph_generated_file*.py``
and removes each file at exit: every worker that ran a Keras job left its files; a
``tempfile.TemporaryDirectory`` still open at the end is removed at exit too).
"""

import atexit
import gc
import os
from multiprocessing import util

#: This fork server's process id (its workers inherit the value).
_SERVER_PID = os.getpid()


def _exit_as_spawned(_: object) -> None:
    # multiprocessing calls this in each child as it starts, after it has dropped the finalizers
    # the child inherited, and runs the child's finalizers as its target returns, before
    # os._exit: lowest priority, so after multiprocessing's own, where a spawned process's
    # interpreter exit runs its atexit handlers. Only in the server's own children: a process a
    # worker forks in turn (a DataLoader's worker) inherits its parent's handlers, which are
    # not its to run (they would remove files the worker still uses).
    if os.getppid() == _SERVER_PID:
        util.Finalize(None, atexit._run_exitfuncs, exitpriority=-1000)


class _Forks:
    """The object multiprocessing's after-fork registry holds the hook by (kept alive here)."""


_FORKS = _Forks()
util.register_after_fork(_FORKS, _exit_as_spawned)

gc.freeze()
