"""The embedded cluster's workers, forked from a server that has imported torch once for all.

Dask's nannies spawn each worker as a fresh interpreter that imports distributed (0.3 s) and then,
for training, torch (0.9 s): on a 2-core machine the two workers' imports and the client's own
start-up took both cores for 1.5 s before the first step. Python's ``forkserver`` start method
imports them once, in a server process started before the scheduler, while this process starts
the scheduler and imports dask.array; each worker is then a fork of that server and starts in
0.2 s with torch already imported (the time-to-accuracy job's first step 3.8 s -> 3.0 s).

A fork server runs for the rest of the program, with the environment it was started with: a
worker forked from it does not see environment variables set in this process later. So it is used
only while this process's environment (with the nanny's ``pre-spawn-environ``) is the one the
server started with, and otherwise the workers are spawned as Dask does by default. The server
forks only while it is single-threaded: with ``OMP_NUM_THREADS=1`` (Dask's default for its
workers) importing torch starts no thread; a fork of a process whose OpenMP pool is running
can hang in the child's first parallel region.

``dt.run`` starting the embedded cluster also has the server import what its function imports
(:func:`function_imports`; ``runtime._fork_imports``): Hugging Face's ``Trainer`` took each
rank 3.2 s of CPU to import after torch's 1.2 s, once the job was placed; imported once in the
server, a rank's first step came sooner (``benchmarks/huggingface.py``, medians of three
seeds: 6.3 s -> 5.2 s with ``dt.connect(imports=...)`` before the script reads its data, the
server importing meanwhile; 5.8 s with ``dt.run`` starting the cluster once the data is read).
"""

from __future__ import annotations

import dis
import importlib.util
import json
import logging
import multiprocessing
import os
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import dask

logger = logging.getLogger(__name__)

#: The environment the fork server was started with, once this module started it.
_server_env: dict[str, str] | None = None
_lock = threading.Lock()

#: How :func:`fork_workers` hands the server its imports (``runtime._fork_imports`` reads it):
#: a preload list holds module names only, and a package's lazily imported name (transformers'
#: ``Trainer``) is an attribute of it.
IMPORTS_ENV = "DASK_TRAIN_FORK_IMPORTS"

#: Packages the server never imports for a function: they start threads as they are imported,
#: and a process forked from a multi-threaded one can hang on a lock a vanished thread held.
_THREADED_AT_IMPORT = frozenset({"tensorflow", "keras", "tf_keras", "jax", "ray"})


def fork_workers(pre_spawn_environ: Mapping[str, Any], imports: Sequence[str] = ()
                 ) -> dict[str, Any]:
    """Start the fork server if it can serve the embedded cluster; the Dask config to use it.

    Parameters
    ----------
    pre_spawn_environ : mapping
        The nannies' ``distributed.nanny.pre-spawn-environ``: set in this process's environment
        before the server starts, as each nanny sets it before it spawns a worker.
    imports : sequence of str
        More for the server to import before it forks a worker, each ``"module"`` or
        ``"module:name,name"`` (see :func:`function_imports`); only where this call starts the
        server.

    Returns
    -------
    dict
        ``{"distributed.worker.multiprocessing-method": "forkserver"}`` to set while the cluster
        starts, or ``{}`` where the workers must be spawned (see the module's docstring): the
        config ``dask-train.fork-workers`` is false, ``distributed.worker.multiprocessing-method``
        is not its default ``spawn``, this is not Linux, ``OMP_NUM_THREADS`` is not 1, another
        part of the program started the fork server, or the environment changed since it started.
    """
    global _server_env
    if not dask.config.get("dask-train.fork-workers", True) or not sys.platform.startswith("linux"):
        return {}
    if dask.config.get("distributed.worker.multiprocessing-method") != "spawn" or \
            "forkserver" not in multiprocessing.get_all_start_methods():
        return {}
    pre_spawn = {str(k): str(v) for k, v in pre_spawn_environ.items()}
    # The nanny's own rule (Nanny.__init__), applied before the server starts: the workers must
    # share one string hash seed with those a nanny spawns later (a restart after a loss).
    if pre_spawn.get("PYTHONHASHSEED") in (None, "0"):
        pre_spawn["PYTHONHASHSEED"] = "6640"
    env = {**os.environ, **pre_spawn}
    if env.get("OMP_NUM_THREADS") != "1":
        return {}
    from multiprocessing import forkserver

    server = forkserver._forkserver  # private: the one server this process's forks go through
    with _lock:
        running = getattr(server, "_forkserver_pid", "unknown")
        if running == "unknown" or (running is not None and _server_env is None):
            return {}  # started by another part of the program: its modules, its environment
        if _server_env is not None and env != _server_env:
            logger.debug("the environment changed since the fork server started: "
                         "the embedded cluster's workers are spawned")
            return {}
        os.environ.update(pre_spawn)
        starting = _server_env is None
        if starting:
            preload = ["distributed", "dask_train.runtime._plugin"]
            if "torch" in sys.modules:  # the program trains with torch: its workers will too
                preload.append("torch")
            if imports:
                preload.append("dask_train.runtime._fork_imports")
                os.environ[IMPORTS_ENV] = json.dumps(list(imports))
            preload.append("dask_train.runtime._fork_ready")
            multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
            _skip_distributed_preload()
        try:
            forkserver.ensure_running()
        finally:
            if starting:
                os.environ.pop(IMPORTS_ENV, None)  # the server's alone: not in `env` either
        _server_env = env
    return {"distributed.worker.multiprocessing-method": "forkserver"}


def _skip_distributed_preload() -> None:
    """Keep distributed from importing its preload list here and replacing ours.

    Private part touched: ``distributed.utils.get_mp_context`` imports pandas, numpy and lz4 in
    this process on its first forkserver call (0.3 s) to set them as the server's preload, and
    marks that done in ``_forkserver_preload_set``; ours is set already.
    """
    import distributed.utils

    if hasattr(distributed.utils, "_forkserver_preload_set"):
        distributed.utils._forkserver_preload_set = True


def function_imports(fn: Callable[..., Any]) -> list[str]:
    """What ``fn`` will import on a worker, for the fork server to import first.

    Its own ``import`` statements (its nested functions' too, and those of the functions of
    its module it calls, which travel with it by value), and the modules of the names it uses
    from its module's globals (a module; a class or function of one), each as ``"module"`` or
    ``"module:name,name"`` (``from module import name``); ``torch._dynamo`` where it uses
    ``torch.optim`` (a torch optimizer imports it as it is built). Only installed packages and the
    standard library, none of :data:`_THREADED_AT_IMPORT`: a module of the program's own may
    do anything as it is imported (read data, take a GPU), which the server must not.

    Examples
    --------
    >>> def train(ctx):
    ...     import json
    ...     from collections import OrderedDict
    >>> function_imports(train)
    ['collections:OrderedDict', 'json']
    """
    found: dict[str, set[str]] = {}
    seen: set[int] = set()
    todo = [fn]
    optim = False
    while todo:
        function = todo.pop()
        code = getattr(function, "__code__", None)
        if not isinstance(code, types.CodeType) or id(code) in seen:
            continue
        seen.add(id(code))
        names = getattr(function, "__globals__", {})
        for each in _codes(code):
            _statements(each, found)
            optim = optim or "optim" in each.co_names
            for name in each.co_names:
                value = names.get(name)
                # type(), not isinstance: a proxy's own __getattribute__ answers __class__.
                if type(value) is types.FunctionType and value.__module__ == \
                        function.__module__:
                    todo.append(value)  # travels with fn by value: its imports run there too
                elif name in names:
                    module = _module_of(value)
                    if module:
                        found.setdefault(module, set())
    # A torch optimizer imports torch._dynamo as it is built (torch._disable_dynamo wraps
    # add_param_group): 0.9 s of CPU on each rank whose loop builds one, before its first step.
    if ("torch" in found and (optim or "optim" in found["torch"])) or "torch.optim" in found:
        found.setdefault("torch._dynamo", set())
    return [f"{module}:{','.join(sorted(attrs))}" if attrs else module
            for module, attrs in sorted(found.items()) if _installed(module)]


def _module_of(value: Any) -> str | None:
    """The module a global value is, or belongs to (a class, a function, an instance's class)."""
    try:
        if isinstance(value, types.ModuleType):
            return value.__name__
        module = getattr(value, "__module__", None)
    except Exception:  # noqa: BLE001 - a proxy's own __getattribute__: no module to find
        return None
    return module if isinstance(module, str) else None


def _codes(code: types.CodeType) -> list[types.CodeType]:
    """``code`` and every code object nested in it (inner functions, comprehensions)."""
    codes, todo = [], [code]
    while todo:
        each = todo.pop()
        codes.append(each)
        todo += [c for c in each.co_consts if isinstance(c, types.CodeType)]
    return codes


def _statements(code: types.CodeType, found: dict[str, set[str]]) -> None:
    """Add the absolute ``import`` statements of ``code`` (not its nested code) to ``found``."""
    consts: list[Any] = []
    module = None
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_CONST":
            consts.append(instruction.argval)
        elif instruction.opname == "IMPORT_NAME":
            level, fromlist = consts[-2:] if len(consts) >= 2 else (0, None)
            # A relative import names a module of the program's own package: not for the server.
            absolute = level == 0 and bool(instruction.argval)
            if absolute:
                found.setdefault(instruction.argval, set())
            # `from m import a` reads a from m; `import m.a as x` reads m's parts, no names.
            module = instruction.argval if absolute and fromlist else None
        elif instruction.opname == "IMPORT_FROM" and module is not None:
            found[module].add(instruction.argval)
        elif instruction.opname not in ("STORE_FAST", "STORE_NAME", "STORE_GLOBAL",
                                        "STORE_DEREF", "POP_TOP", "SWAP", "COPY"):
            module = None  # the statement ended


def _installed(module: str) -> bool:
    """Whether ``module`` belongs to the standard library or an installed package (not the
    program's own code, nor a package that starts threads as it is imported)."""
    top = module.partition(".")[0]
    if top in ("__main__", "builtins") or top in _THREADED_AT_IMPORT:
        return False
    if top in sys.stdlib_module_names:
        return True
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    origin = str(getattr(spec, "origin", None) or "")
    return "site-packages" in origin or "dist-packages" in origin
