"""What runs inside the Dask worker processes for :func:`dask_train.start_tensorflow`.

Each worker keeps a :class:`TFState` on the worker object: the ports it reserved, the
``tf.distribute.Server`` objects it started (they must stay referenced: a TF server cannot be
stopped, and its destructor is not a clean shutdown), and the start ids abandoned by the client
(a task of an abandoned start that runs late does nothing). TensorFlow is imported in the tasks,
in the worker's thread pool, never on its event loop.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distributed import get_worker

from dask_train.runtime._hosts import worker_host

_ATTR = "_dask_train_tensorflow"
_LOCK = threading.Lock()

#: Inter-op threads of every server: with 1, a ParameterServerStrategy step hung here (a remote
#: function's receive waited on the only inter-op thread).
INTER_OP_THREADS = 2


@dataclass
class TFState:
    """The TensorFlow servers of dask-train in one worker process."""

    servers: dict[tuple[str, str, int], Any] = field(default_factory=dict)  # (start, role, i)
    reserved: dict[tuple[str, str, int], socket.socket] = field(default_factory=dict)
    abandoned: set[str] = field(default_factory=set)


def tf_state(worker: Any = None) -> TFState:
    """This worker's :class:`TFState` (created on first use)."""
    worker = worker or get_worker()
    with _LOCK:
        state = getattr(worker, _ATTR, None)
        if state is None:
            state = TFState()
            setattr(worker, _ATTR, state)
        return state


def _reserve(host: str) -> socket.socket:
    """A socket bound to a port the OS chose, held until the server takes the port.

    Bound on every address (TensorFlow's gRPC server listens on ``0.0.0.0:port``), and held while
    TensorFlow is imported and the other workers reserve theirs: a port picked and released at
    once was taken by another process before the server started (seen here, with several
    clusters on one machine). Released just before the server binds it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind(("::" if family == socket.AF_INET6 else "", 0))
    return sock


def prepare(start: str, roles: Sequence[tuple[str, int]]) -> list[str]:
    """Dask task: import TensorFlow here and reserve one port per role; ``host:port`` for each.

    Returns ``[]`` when the client abandoned this start (a task that ran late).
    """
    worker = get_worker()
    state = tf_state(worker)
    if start in state.abandoned:
        return []
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    import tensorflow  # noqa: F401  (the slow part: seconds, and more on a busy machine)

    host = worker_host(worker.address)
    out = []
    with _LOCK:
        if start in state.abandoned:  # given up while TensorFlow was importing
            return []
        for role, index in roles:
            sock = _reserve(host)
            state.reserved[(start, role, index)] = sock
            port = sock.getsockname()[1]
            out.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return out


def start_server(start: str, spec: Mapping[str, Sequence[str]], role: str, index: int,
                 threads: int, tf_config: bool) -> str:
    """Dask task: start the TensorFlow server of ``role`` ``index`` on its reserved port.

    With ``tf_config``, this process's ``TF_CONFIG`` names this role (its first one).
    """
    import tensorflow as tf

    state = tf_state()
    with _LOCK:
        if start in state.abandoned:
            return ""
        sock = state.reserved.pop((start, role, index), None)
        if sock is not None:
            sock.close()
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=max(1, threads),
                                          inter_op_parallelism_threads=INTER_OP_THREADS)
        server = tf.distribute.Server(tf.train.ClusterSpec(dict(spec)), job_name=role,
                                      task_index=index, protocol="grpc", config=config, start=True)
        state.servers[(start, role, index)] = server
    if tf_config:
        os.environ["TF_CONFIG"] = json.dumps(config_for(spec, role, index))
    return str(server.target)


def config_for(spec: Mapping[str, Sequence[str]], role: str, index: int) -> dict[str, Any]:
    """The ``TF_CONFIG`` of one role: the whole cluster and this task."""
    return {"cluster": {k: list(v) for k, v in spec.items()},
            "task": {"type": role, "index": int(index)}}


def abandon(start: str, dask_worker: Any = None) -> tuple[int, int]:
    """Run on workers (``client.run``): give up a start here; (servers started, ports released)."""
    state = tf_state(dask_worker)
    with _LOCK:
        state.abandoned.add(start)
        mine = [key for key in state.reserved if key[0] == start]
        for key in mine:
            state.reserved.pop(key).close()
        return sum(1 for key in state.servers if key[0] == start), len(mine)


def holders(dask_worker: Any = None) -> list[str]:
    """Run on workers (``client.run``): the starts whose servers live in this process."""
    state = getattr(dask_worker, _ATTR, None)
    return sorted({key[0] for key in state.servers}) if state is not None else []


def run_as(tf_config: Mapping[str, Any], fn: Callable[..., Any], args: Sequence[Any],
           kwargs: Mapping[str, Any]) -> Any:
    """Dask task: call ``fn`` with ``TF_CONFIG`` naming one role (see ``TensorFlowCluster.submit``)."""
    os.environ["TF_CONFIG"] = json.dumps(dict(tf_config))
    return fn(*args, **kwargs)
