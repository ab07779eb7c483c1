"""``start_tensorflow``: a distributed TensorFlow cluster stood up inside Dask worker processes.

The 2017 Dask + TensorFlow workflow, on TensorFlow 2: roles (parameter servers, workers, a scorer)
are placed on the live Dask workers by :func:`~dask_train.policy.plan_roles`; every worker imports
TensorFlow in a task and reserves a port from the OS per role it holds; once every port is known,
each role's ``tf.distribute.Server`` starts on its port with the whole cluster spec. The user's
own TensorFlow code then runs as Dask tasks on those workers (:meth:`TensorFlowCluster.submit`
sets ``TF_CONFIG`` for the role), or as a ParameterServerStrategy coordinator in the client
(:meth:`TensorFlowCluster.coordinator_resolver`).
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from distributed import Client, Future
from distributed.utils import get_ip

from dask_train.data._stall import wait_futures
from dask_train.errors import InvalidInput, RoleFailed, TrainingTimeout
from dask_train.policy._placement import KINDS, SEED_TRAINER, check_role_counts, plan_roles
from dask_train.runtime._calls import live_workers
from dask_train.runtime._hosts import worker_host
from dask_train.runtime._roles import worker_threads
from dask_train.tensorflow import _server

logger = logging.getLogger(__name__)

# TensorFlow's task type for a trainer is the seed's "worker" (TF_CONFIG, ClusterSpec). The kinds
# in the order they are placed and get ``TF_CONFIG`` on a shared process: KINDS, so named.
_TF_TASK = {"trainer": SEED_TRAINER}
TF_KINDS = tuple(_TF_TASK.get(kind, kind) for kind in KINDS)


def _pin(address: str) -> dict[str, Any]:
    # A server lives in one process: its tasks must run there. pure=False: each call starts or
    # reserves something, so it must run every time it is submitted.
    return {"workers": [address], "allow_other_workers": False, "pure": False}


class TensorFlowCluster:
    """TensorFlow servers inside Dask workers, made by :func:`start_tensorflow`.

    Unpacks as the pair ``(tf_spec, dask_spec)`` of the original workflow; a context manager that
    calls :meth:`close`.

    Attributes
    ----------
    spec : dict of str to list of str
        Role -> ``host:port`` of each server (the cluster spec as a plain dict).
    dask_spec : dict of str to list of str
        Role -> the Dask worker address holding each server.
    start_id : str
        This start's id (in its task keys).
    closed : bool

    Examples
    --------
    >>> cluster = dt.start_tensorflow(client, ps=1, worker=2, scorer=1)   # doctest: +SKIP
    >>> tf_spec, dask_spec = cluster                                      # doctest: +SKIP
    >>> tf_spec.as_dict()                                                 # doctest: +SKIP
    {'ps': ['10.0.0.5:41243'], 'scorer': ['10.0.0.6:38211'], 'worker': [...]}
    >>> cluster.close()      # restarts the workers that hold servers       # doctest: +SKIP
    """

    def __init__(self, *, client: Client, start_id: str, spec: dict[str, list[str]],
                 dask_spec: dict[str, list[str]], timeout: float) -> None:
        self.client, self.start_id, self.spec, self.dask_spec = client, start_id, spec, dask_spec
        self.timeout = timeout
        self.closed = False

    @property
    def tf_spec(self) -> Any:
        """The cluster spec as a ``tf.train.ClusterSpec`` (imports TensorFlow in this process)."""
        import tensorflow as tf

        return tf.train.ClusterSpec(self.spec)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.tf_spec, self.dask_spec))

    def tf_config(self, role: str, index: int = 0) -> dict[str, Any]:
        """The ``TF_CONFIG`` of one role: ``{"cluster": spec, "task": {"type", "index"}}``."""
        if index not in range(len(self.spec.get(role, []))):
            raise InvalidInput([f"role={role!r}, index={index!r} is not a server of this cluster: "
                                f"it has {self._counts()}."])
        return _server.config_for(self.spec, role, index)

    def _counts(self) -> dict[str, int]:
        return {role: len(addrs) for role, addrs in self.spec.items()}

    def submit(self, fn: Callable[..., Any], *args: Any, role: str, index: int = 0,
               **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` as a Dask task on the worker of ``role`` ``index``, with
        ``TF_CONFIG`` naming that role.

        ``TF_CONFIG`` is set in the worker process when the task starts. A process that holds
        several roles (fewer Dask workers than roles) has one environment: the task that started
        last set it, so read it at the start of ``fn`` (``TFConfigClusterResolver()`` does) or
        use :meth:`tf_config`.
        """
        if self.closed:
            raise RuntimeError("this TensorFlow cluster is closed: start a new one with "
                               "dt.start_tensorflow.")
        config = self.tf_config(role, index)
        return self.client.submit(_server.run_as, config, fn, list(args), kwargs,
                                  key=f"{getattr(fn, '__name__', 'fn')}-{role}-{index}-"
                                      f"{uuid.uuid4().hex[:8]}",
                                  **_pin(self.dask_spec[role][index]))

    def coordinator_resolver(self) -> Any:
        """A ``SimpleClusterResolver`` for a ParameterServerStrategy coordinator in this process.

        Its cluster holds the ``ps`` and ``worker`` servers and a ``chief`` (this process) at the
        address that reaches the scheduler, on a port the OS picks now and TensorFlow binds when
        the strategy is created. Roles other than ps and worker (the scorer) are left out:
        ParameterServerStrategy refuses job names other than chief, ps, worker and evaluator.

        Examples
        --------
        >>> strategy = tf.distribute.ParameterServerStrategy(cluster.coordinator_resolver())  # doctest: +SKIP
        """
        import tensorflow as tf

        scheduler = self.client.scheduler.address  # type: ignore[union-attr]
        host = get_ip(worker_host(scheduler))
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        chief = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        spec = {"ps": self.spec.get("ps", []), "worker": self.spec["worker"], "chief": [chief]}
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")

    def close(self) -> None:
        """Restart the Dask workers that hold this cluster's servers and wait until they are back.

        A ``tf.distribute.Server`` cannot be stopped (TensorFlow has no clean shutdown for it), so
        the only way to free its port and threads is to end its process: the workers' nannies
        start fresh processes, with new addresses and without the data they held (Dask recomputes
        what it can). After ``close()`` the same workers can take a new :func:`start_tensorflow`.
        Workers without a nanny cannot be restarted: their servers stay until they exit (a
        warning says which). Calling it again does nothing.
        """
        if self.closed:
            return
        addresses = sorted({a for addrs in self.dask_spec.values() for a in addrs})
        _restart(self.client, addresses, timeout=self.timeout)
        self.closed = True

    def __enter__(self) -> TensorFlowCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"TensorFlowCluster({self.start_id!r}, {self.spec}, {state})"


def _restart(client: Client, addresses: list[str], *, timeout: float) -> None:
    """Restart the live ones of ``addresses`` that have a nanny; wait until they are back."""
    info = live_workers(client)
    live = [a for a in addresses if a in info]
    alone = [a for a in live if not info[a].get("nanny")]
    if alone:
        logger.warning("workers %s have no nanny and cannot be restarted: their TensorFlow "
                       "servers stay until those processes end", alone)
    targets = [a for a in live if a not in alone]
    if not targets:
        return
    status = client.restart_workers(targets, timeout=timeout, raise_for_error=False)
    late = {a: s for a, s in status.items() if s != "OK"}
    if late:
        raise TrainingTimeout(f"restarting the workers that held TensorFlow servers did not "
                              f"finish within {timeout:g} s: {late}")


def start_tensorflow(client: Client, *, ps: int = 1, worker: int = 1, scorer: int = 1,
                     timeout: float = 120.0) -> TensorFlowCluster:
    """Start TensorFlow servers for ``ps``, ``worker`` and ``scorer`` roles inside Dask workers.

    Roles are placed on the live workers by :func:`dask_train.policy.plan_roles` (trainers first,
    one per worker, then servers and the scorer on the least-loaded), sharing processes when there
    are fewer workers than roles: a process can hold several servers. Ports come from the OS.
    Each worker's ``TF_CONFIG`` names the first role it holds; :meth:`TensorFlowCluster.submit`
    runs a task with the ``TF_CONFIG`` of any role.

    Parameters
    ----------
    client : distributed.Client
    ps, worker, scorer : int
        Parameter servers (>= 0), workers (>= 1) and scorers (0 or 1).
    timeout : float
        Seconds for importing TensorFlow on the workers (the slow part) and again for starting
        the servers; past either, :class:`~dask_train.errors.TrainingTimeout` names the roles and
        workers that did not come up.

    Returns
    -------
    TensorFlowCluster
        Unpacks as ``(tf_spec, dask_spec)``: a ``tf.train.ClusterSpec`` and role -> Dask worker
        addresses.

    Raises
    ------
    InvalidInput
        Bad counts or timeout, or workers that still hold servers of an earlier start (close it
        first), before anything is submitted.
    TrainingTimeout, RoleFailed
        A server did not come up in time, or failed to start; what had started is torn down.

    Examples
    --------
    >>> tf_spec, dask_spec = dt.start_tensorflow(client, ps=1, worker=2, scorer=1)  # doctest: +SKIP
    >>> dask_spec                                                                     # doctest: +SKIP
    {'worker': ['tcp://10.0.0.5:40233', 'tcp://10.0.0.6:41877'], 'ps': [...], 'scorer': [...]}
    """
    problems = check_role_counts(ps=ps, worker=worker, scorer=scorer, min_ps=0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        problems.append(f"timeout={timeout!r} is invalid: use a number of seconds > 0.")
    if problems:
        raise InvalidInput(problems)
    busy = {a: starts for a, starts in client.run(_server.holders).items() if starts}
    if busy:
        raise InvalidInput([
            f"workers {sorted(busy)} still hold the TensorFlow servers of an earlier "
            "start_tensorflow: call its close() first (a TF server cannot be stopped; close() "
            "restarts those workers)."])
    threads = worker_threads(client)
    placement = {_TF_TASK.get(kind, kind): addresses for kind, addresses
                 in plan_roles(threads, ps=ps, worker=worker, scorer=scorer).items()}
    start_id = f"tf-{uuid.uuid4().hex[:8]}"
    on: dict[str, list[tuple[str, int]]] = {}  # worker -> its roles, in placement order
    for kind in TF_KINDS:
        for i, address in enumerate(placement[kind]):
            on.setdefault(address, []).append((kind, i))
    try:
        spec = _reserve_ports(client, start_id, on, timeout=timeout)
        _start_servers(client, start_id, spec, on, threads, timeout=timeout)
    except BaseException:
        _abandon(client, start_id, list(on), timeout=timeout)
        raise
    dask_spec = {kind: list(placement[kind]) for kind in TF_KINDS}
    return TensorFlowCluster(client=client, start_id=start_id, spec=spec, dask_spec=dask_spec,
                             timeout=timeout)


def _describe(on: Mapping[str, list[tuple[str, int]]], addresses: list[str]) -> str:
    return "; ".join(f"{', '.join(f'{k}-{i}' for k, i in on[a])} on {a}" for a in addresses)


def _wait(client: Client, futures: Mapping[Any, Future], *, timeout: float, what: str,
          on: Mapping[str, list[tuple[str, int]]], where: Callable[[Any], str]) -> None:
    """Wait for one task per key; past ``timeout`` or on an error, raise naming roles and workers."""
    deadline = time.monotonic() + timeout
    try:
        # Through this client: distributed.wait uses the default one, which may be another
        # client or none (a client made with set_as_default=False).
        client.sync(wait_futures, list(futures.values()), timeout=timeout)
    except TimeoutError:
        pass
    late = [key for key, f in futures.items() if not f.done()]
    if late:
        # Queued tasks must not start later; one already running finds its start abandoned.
        client.cancel(list(futures.values()))
        addresses = sorted({where(key) for key in late})
        raise TrainingTimeout(
            f"{_describe(on, addresses)}: did not {what} within {timeout:g} s (is the worker "
            "busy with another task, or slow to import TensorFlow? raise timeout=); the servers "
            "that had started were torn down.")
    for key, f in futures.items():
        if f.status == "error":
            exc = f.exception(timeout=max(0.0, deadline - time.monotonic()) + 1)
            # A message, not the stored exception re-raised: its frames would pin the futures.
            raise RoleFailed(f"{_describe(on, [where(key)])}: could not {what}: "
                             f"{type(exc).__name__}: {exc}")


def _reserve_ports(client: Client, start_id: str, on: Mapping[str, list[tuple[str, int]]], *,
                   timeout: float) -> dict[str, list[str]]:
    """Import TensorFlow on every worker that holds roles and reserve their ports; the spec."""
    futures = {a: client.submit(_server.prepare, start_id, roles,
                                key=f"dt-tf-prepare-{start_id}-{n}", **_pin(a))
               for n, (a, roles) in enumerate(on.items())}
    _wait(client, futures, timeout=timeout, what="import TensorFlow and reserve ports", on=on,
          where=lambda a: a)
    spec: dict[str, list[str]] = {kind: [] for kind in TF_KINDS}
    found: dict[tuple[str, int], str] = {}
    for address, fut in futures.items():
        for role, target in zip(on[address], fut.result()):
            found[role] = target
    for kind in TF_KINDS:
        count = sum(1 for roles in on.values() for k, _ in roles if k == kind)
        spec[kind] = [found[(kind, i)] for i in range(count)]
    return {kind: targets for kind, targets in spec.items() if targets}


def _start_servers(client: Client, start_id: str, spec: Mapping[str, list[str]],
                   on: Mapping[str, list[tuple[str, int]]], threads: Mapping[str, int], *,
                   timeout: float) -> None:
    """Start every role's server on its reserved port."""
    where: dict[tuple[str, int], str] = {}
    futures: dict[tuple[str, int], Future] = {}
    for address, roles in on.items():
        for n, (kind, i) in enumerate(roles):
            where[(kind, i)] = address
            futures[(kind, i)] = client.submit(
                _server.start_server, start_id, dict(spec), kind, i, threads.get(address, 1),
                n == 0, key=f"dt-tf-server-{start_id}-{kind}-{i}", **_pin(address))
    _wait(client, futures, timeout=timeout, what="start its TensorFlow server", on=on,
          where=lambda key: where[key])


def _abandon(client: Client, start_id: str, addresses: list[str], *, timeout: float) -> None:
    """After a failed start: no late task may start anything; restart workers holding servers."""
    info = live_workers(client)
    live = [a for a in addresses if a in info]
    if not live:
        return
    answers = client.run(_server.abandon, start_id, workers=live, on_error="return")
    started = [a for a, got in answers.items() if isinstance(got, tuple) and got[0]]
    try:
        _restart(client, started, timeout=timeout)
    except Exception:  # the start's own error is what the caller needs to see
        logger.warning("restarting %s after a failed start_tensorflow failed", started,
                       exc_info=True)
