"""``connect()``: the embedded LocalCluster by default, any Dask scheduler by address."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import dask
from distributed import Client, get_client

from dask_train.errors import ClusterUnreachable, InvalidInput
from dask_train.runtime._compat import start_workers_without_main
from dask_train.runtime._fork import fork_workers
from dask_train.runtime._plugin import PLUGIN_NAME, DaskTrainPlugin
from dask_train.runtime._quiet_logs import quiet_scheduler
from dask_train.runtime._roles import remember_handlers
from dask_train.runtime._versions import check_once, check_versions, mark_checked

logger = logging.getLogger(__name__)

# Dask's nanny sets MALLOC_TRIM_THRESHOLD_=64 KiB so workers give memory back eagerly. For training
# that means every optimizer step re-faults its temporaries from the kernel: on the large MLP it
# doubled Adam's step time. These thresholds keep buffers of up to 64 MiB in the heap.
_MALLOC_ENV = {
    "MALLOC_TRIM_THRESHOLD_": str(256 * 2**20),
    "MALLOC_MMAP_THRESHOLD_": str(64 * 2**20),
}


#: distributed's own default for ``distributed.deploy.lost-worker-timeout`` (see ``_embedded``).
_LOST_WORKER_DEFAULT = "15s"


def connect(
    address: str | None = None,
    *,
    n_workers: int | None = None,
    threads_per_worker: int = 1,
    torch_threads: int | None = None,
    timeout: float = 30.0,
    dashboard: bool = True,
    quiet: bool = False,
    security: Any = None,
    imports: Sequence[str] = (),
    **cluster_kwargs: Any,
) -> Client:
    """Connect to a Dask cluster, or start an embedded one on this machine.

    Parameters
    ----------
    address : str, optional
        Scheduler address such as ``"tcp://10.0.0.5:8786"``. When omitted, ``DASK_SCHEDULER_ADDRESS``
        is used if set; otherwise a LocalCluster with worker processes starts here and closes with
        the returned client.
    n_workers : int, optional
        Embedded cluster only: number of worker processes (default: the number of cores).
    threads_per_worker : int
        Embedded cluster only: Dask threads per worker (default 1; training roles secede from the
        thread pool, so one thread is enough to feed data).
    torch_threads : int, optional
        torch intra-op threads on each worker; default: the worker's thread count.
    timeout : float
        Seconds to wait for the scheduler before raising :class:`ClusterUnreachable`.
    dashboard : bool
        Embedded cluster only: serve the dashboard on a free port and log its link.
    quiet : bool
        Do not print the dashboard link (it goes to stderr).
    security : distributed.Security or True, optional
        TLS. With an address: the client's certificates for a ``tls://`` scheduler, e.g.
        ``Security(tls_ca_file="ca.pem", tls_client_cert="cert.pem", tls_client_key="key.pem",
        require_encryption=True)`` (default: Dask's ``distributed.comm.tls`` config). True: the
        embedded cluster on TLS, temporary certificates (needs ``cryptography``).
    imports : sequence of str
        Embedded cluster only: modules its workers start with, each ``"module"`` or
        ``"module:name,name"`` (a name a package imports lazily, as transformers' ``Trainer``):
        imported once, in the process the workers are forked from (Linux; see
        ``docs/training.md``), rather than by each worker. ``dt.run`` passes its function's own
        imports when it starts the cluster itself. A module that fails there is left for the
        workers to import.
    **cluster_kwargs
        Passed to :class:`distributed.LocalCluster` for the embedded cluster.

    Returns
    -------
    distributed.Client

    Examples
    --------
    >>> client = connect()                              # doctest: +SKIP
    >>> client = connect("tcp://scheduler:8786")        # doctest: +SKIP
    >>> client = connect("tls://scheduler:8786", security=Security(...))  # doctest: +SKIP
    """
    address = address or os.environ.get("DASK_SCHEDULER_ADDRESS") or None
    problems = _problems(n_workers=n_workers, threads_per_worker=threads_per_worker,
                         torch_threads=torch_threads, timeout=timeout, imports=imports)
    problems += _security_problems(security, address)
    if problems:
        raise InvalidInput(problems)

    if address is None:
        if security is not None:
            cluster_kwargs["security"] = security  # True: Client starts the LocalCluster on TLS
        client = _embedded(
            n_workers=n_workers or os.cpu_count() or 1,
            threads_per_worker=threads_per_worker,
            dashboard=dashboard,
            imports=imports,
            **cluster_kwargs,
        )
    else:
        client = _remote(address, timeout=timeout, security=security)
    return _set_up(client, torch_threads=torch_threads,
                   link=client.dashboard_link if dashboard or address else None, quiet=quiet)


def _set_up(client: Client, *, torch_threads: int | None, link: str | None,
            quiet: bool) -> Client:
    """``client`` with dask-train's plugin on every worker, its dashboard link said."""
    # A program that imported torch will train with it: the workers import it meanwhile. Not
    # torch._dynamo: the built-in optimizers no longer need it (see runtime._compat).
    preload = ("torch",) if "torch" in sys.modules else ()
    client.register_plugin(DaskTrainPlugin(torch_threads, preload=preload), name=PLUGIN_NAME)
    remember_handlers(client)
    if link and not quiet:
        # stderr, like a log line: a script's stdout stays its own (results, pipes).
        print(f"dask-train: dashboard at {link}", file=sys.stderr)
    logger.debug("connected to %s (dashboard %s)", client.scheduler.address, link)
    return client


def default_client(*, quiet: bool = False, imports: Sequence[str] = ()) -> Client:
    """The client to use when none was given: the current one, else a new embedded cluster.

    "Current" as :func:`distributed.get_client` sees it: inside a task, the worker's client;
    inside ``with client.as_current()`` (a search trial's thread), that client; else the global
    default client. Only when there is none does it start one with :func:`connect` (the embedded
    LocalCluster, or ``DASK_SCHEDULER_ADDRESS``); that client is the global default from then on,
    so the next call returns it instead of starting another cluster.

    Parameters
    ----------
    quiet : bool
        Passed to :func:`connect`: do not print the dashboard link of a new cluster.
    imports : sequence of str
        Passed to :func:`connect`: what a new cluster's workers start with.

    Examples
    --------
    >>> client = default_client()                      # doctest: +SKIP
    """
    try:
        client = get_client()
    except ValueError:  # no client anywhere: the embedded default
        return connect(quiet=quiet, imports=imports)
    return check_once(client)  # a client made otherwise: its scheduler and workers, once


def _embedded(
    *, n_workers: int, threads_per_worker: int, dashboard: bool, imports: Sequence[str] = (),
    **cluster_kwargs: Any
) -> Client:
    # ":0": a free port, never the fixed 8787 that another cluster on this host may hold.
    dashboard_address = ":0" if dashboard else None
    kwargs: dict[str, Any] = {
        "n_workers": n_workers,
        "threads_per_worker": threads_per_worker,
        "processes": True,
        "dashboard_address": dashboard_address,
    }
    kwargs.update(cluster_kwargs)
    # Workers never re-run the user's script (see _compat): it saves each of them the script's
    # own imports, and a script without the __main__ guard starts as a notebook would.
    start_workers_without_main()
    quiet_scheduler()  # the embedded cluster's scheduler runs in this process
    if dask.config.get("distributed.deploy.lost-worker-timeout") == _LOST_WORKER_DEFAULT:
        # The embedded cluster closes for good a nanny whose killed worker is not back within
        # this time; Dask's 15 s was short on a loaded 2-core machine (a restart took 18 s) and
        # the job went on one worker short. Read when a worker leaves: set for the process.
        dask.config.set({"distributed.deploy.lost-worker-timeout": "120s"})
    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
    environ.update(_MALLOC_ENV)
    with dask.config.set({"distributed.nanny.pre-spawn-environ": environ}):
        # The workers forked from a server importing torch meanwhile, where it can (runtime._fork);
        # only while these workers start: a nanny restarting one after a loss spawns it.
        start = fork_workers(environ, imports)
        if start:
            _import_dask_array()
        with dask.config.set(start):
            # No address: Client starts the LocalCluster itself and closes it with the client.
            client = Client(**kwargs)
    # Close the client at the program's end before distributed's own exit handlers (registered
    # at its import, so run after this one) take the workers down under it: that way the
    # scheduler forgets the client's keys first, and the end of every script is quiet (not a
    # "lose already computed task(s)" warning and a "lose scattered data" error per worker).
    atexit.register(_close_at_exit, weakref.ref(client))
    mark_checked(client)  # its scheduler runs here and its workers from this Python
    return client


def _import_dask_array() -> None:
    """Import dask.array now, while the fork server imports torch on another core.

    A fit's data needs it (``dt.from_npy``, ``da.from_array``, the datasets), and this process
    would otherwise wait idle for the workers, then import it (0.5 s) before the fit.
    """
    try:
        import dask.array  # noqa: F401
    except ImportError:  # dask without its array extra: a fit on dataframes needs none
        pass


def _close_at_exit(ref: weakref.ReferenceType[Client]) -> None:
    client = ref()
    if client is None or client.status in ("closing", "closed"):
        return
    try:
        client.close(timeout=10)
    except Exception:  # the program is ending: nothing to do about a failed close
        logger.debug("closing the embedded cluster at exit failed", exc_info=True)


def _problems(*, n_workers: Any, threads_per_worker: Any, torch_threads: Any,
              timeout: Any, imports: Any) -> list[str]:
    """Every problem with ``connect``'s counts, timeout and imports."""
    problems = []
    if n_workers is not None and (not isinstance(n_workers, int) or n_workers < 1):
        problems.append(f"n_workers={n_workers!r} is invalid: use an integer >= 1 or None.")
    if not isinstance(threads_per_worker, int) or threads_per_worker < 1:
        problems.append(
            f"threads_per_worker={threads_per_worker!r} is invalid: use an integer >= 1."
        )
    if torch_threads is not None and (not isinstance(torch_threads, int) or torch_threads < 1):
        problems.append(f"torch_threads={torch_threads!r} is invalid: use an integer >= 1 or None.")
    if not timeout > 0:
        problems.append(f"timeout={timeout!r} is invalid: use a number of seconds > 0.")
    if isinstance(imports, str) or not all(isinstance(m, str) for m in imports):
        problems.append(f"imports={imports!r} is invalid: use a list of module names, e.g. "
                        '["transformers:Trainer"].')
    return problems


def _security_problems(security: Any, address: str | None) -> list[str]:
    """What is wrong with ``security=`` for ``address`` (None: the embedded cluster)."""
    from distributed import Security

    if address is None:
        if security not in (None, True, False):
            return [f"security={type(security).__name__} is invalid for the embedded cluster: "
                    "pass security=True (temporary self-signed certificates), or start "
                    "LocalCluster(security=...) yourself and pass its scheduler_address "
                    "and the same security to dt.connect."]
        return []
    if security is not None and not isinstance(security, Security):
        return [f"security={security!r} is invalid: pass a distributed.Security, e.g. "
                "Security(tls_ca_file='ca.pem', tls_client_cert='cert.pem', "
                "tls_client_key='key.pem', require_encryption=True)."]
    if str(address).startswith("tls://") and security is None and not \
            dask.config.get("distributed.comm.tls.ca-file", None):
        return [f"address={address!r} is a TLS scheduler and no certificates were given: pass "
                "security=distributed.Security(tls_ca_file=..., tls_client_cert=..., "
                "tls_client_key=..., require_encryption=True), or set Dask's "
                "distributed.comm.tls config."]
    return []


def _remote(address: str, *, timeout: float, security: Any = None) -> Client:
    try:
        client = Client(address, timeout=timeout, security=security)
    except (OSError, TimeoutError) as exc:
        raise ClusterUnreachable(
            f"could not reach the Dask scheduler at {address!r} within {timeout:g} s ({exc}). "
            "Check the address and that the scheduler is running, raise timeout=, or call "
            "dt.connect() with no address for an embedded cluster on this machine."
        ) from exc
    try:
        # At once, naming the process and the package: not an ImportError deep in a role's task.
        check_versions(client)
    except BaseException:
        client.close()
        raise
    mark_checked(client)
    return client
