"""A multi-host Dask cluster on one Linux machine: one network namespace per host.

Each "host" (the scheduler and every worker) is a network namespace with its own address and
interface, joined to the others by a veth pair through a bridge, and runs the real ``dask
scheduler`` / ``dask worker`` programs. ``tc`` shapes every host's link: a token bucket (``tbf``)
at ``rate_mbit`` in both directions, and a ``netem`` delay on the way out when ``delay_ms`` is
set (the kernel must have ``sch_netem``). Nothing leaves the namespaces this module creates: the
addresses are private ones on a bridge of its own, and the client reaches the scheduler from the
root namespace through that bridge.

It needs root, ``ip`` and ``tc``. Names carry the creating process's id (``dtn<pid>x<n>``, both in
base 36 so that interface names fit Linux's 15 characters), so a run that crashed is cleaned up
by the next one (:func:`cleanup_leftovers`). :class:`NetnsCluster` has an example.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from dask_train.errors import DaskTrainError, InvalidInput
from dask_train.runtime._hosts import worker_host
from dask_train.runtime._processes import pid_alive

#: Names of everything created start with this, then the owner's pid and a counter, in base 36:
#: namespaces ``dtn<pid>x<n>-s`` (scheduler) and ``-0``, ``-1``...; the bridge ``...b``; the veth
#: ends ``...v0`` (on the bridge) and ``...n0`` (moved into the namespace and renamed ``hnet0``).
PREFIX = "dtn"
_NAME = re.compile(rf"^{PREFIX}([0-9a-z]+)x([0-9a-z]+)(-s|-\d+|b|[vn](s|\d+)|[pq])$")
MAX_HOSTS = 199  # addresses .10 to .208 of the /24; interface names stay within 15 characters
#: Private addresses on our own bridge only: 10.77.<k>.0/24, a free <k> per cluster.
_SUPERNET = ipaddress.ip_network("10.77.0.0/16")
_LOCK_PATH = Path(tempfile.gettempdir()) / "dask-train-netns.lock"
_SCHEDULER_PORT = 8786  # free by construction: the scheduler's namespace is ours alone
_counter = iter(range(10**6))
_counter_lock = threading.Lock()

# Workers keep buffers of up to 64 MiB in the heap, as dt.connect's embedded cluster does (the
# nanny's default trim threshold re-faults every optimizer step's temporaries).
_WORKER_CONFIG = """\
distributed:
  nanny:
    pre-spawn-environ:
      MALLOC_TRIM_THRESHOLD_: "268435456"
      MALLOC_MMAP_THRESHOLD_: "67108864"
"""


class HarnessUnavailable(DaskTrainError, RuntimeError):
    """The multi-host harness cannot run here (not root, no ``ip``/``tc``, a kernel feature)."""


@dataclass(frozen=True)
class Link:
    """A host's network link: its rate each way and an added one-way delay.

    Parameters
    ----------
    rate_mbit : float or None
        Megabits per second in each direction; None leaves the link unshaped (veth speed).
    delay_ms : float
        Milliseconds added to every packet leaving the host (``netem``; needs ``sch_netem``), so
        a round trip between two hosts grows by twice this.

    Examples
    --------
    >>> Link(rate_mbit=1000, delay_ms=0.5).describe()
    '1000 Mbit/s, 0.5 ms'
    """

    rate_mbit: float | None = 1000.0
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            problems.append(f"rate_mbit={self.rate_mbit!r} is invalid: use a number > 0 or None.")
        if not self.delay_ms >= 0:
            problems.append(f"delay_ms={self.delay_ms!r} is invalid: use a number >= 0.")
        if problems:
            raise InvalidInput(problems)

    def describe(self) -> str:
        rate = "unshaped" if self.rate_mbit is None else f"{self.rate_mbit:g} Mbit/s"
        return f"{rate}, {self.delay_ms:g} ms" if self.delay_ms else rate


@dataclass
class Host:
    """One namespace: its name, address, interface inside it, and the processes started in it."""

    name: str  # "scheduler" or "host-3"
    netns: str
    address: str
    iface: str  # the interface name inside the namespace ("hnet3"), distinct per host
    outer: str  # the veth end on the bridge, in the root namespace
    log: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


def unavailable_reason() -> str | None:
    """Why the harness cannot run on this machine, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root, as CI does"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install iproute2)"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise HarnessUnavailable(f"`{' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def _netns_pids(netns: str) -> list[int]:
    out = _run("ip", "netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


#: How long a killed host's resource tracker gets to free what its processes held.
_TRACKER_S = 10.0


def _kill_netns(netns: str, sig: int = signal.SIGKILL) -> list[int]:
    """Kill every process in ``netns``; the pids. Its multiprocessing resource trackers are
    spared until the others are gone: each then frees the named semaphores its processes held
    (``/dev/shm/sem.mp-*``), as a dead host's memory goes with it, and exits (killed after
    :data:`_TRACKER_S`). Killed with the rest, they left those files in this machine's shared
    ``/dev/shm``, a dozen per host killed."""
    pids = _netns_pids(netns)
    trackers = [pid for pid in pids if _is_resource_tracker(pid)]
    for pid in pids:
        if pid not in trackers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    deadline = time.monotonic() + _TRACKER_S
    # A tracker that exited may stay a zombie a while: its cmdline is empty then.
    while any(_is_resource_tracker(pid) for pid in trackers) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in trackers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def cleanup_leftovers() -> list[str]:
    """Remove what a harness whose process is gone left (namespaces, links, its directory);
    return their names.

    Only names of this module's form (``dtn<pid>x<n>...``) whose ``<pid>`` is no longer running
    are touched: a live run's cluster, or anything else on the machine, is left alone.
    """
    removed = []
    # A harness killed with its cluster up also leaves its directory (config, scheduler log).
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*x*-*"):
        match = _NAME.match(path.name.rsplit("-", 1)[0] + "-s")
        if path.is_dir() and match and not pid_alive(int(match.group(1), 36)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.match(name)
        if match and not pid_alive(int(match.group(1), 36)):
            _kill_netns(name)
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        match = _NAME.match(name)
        if match and not pid_alive(int(match.group(1), 36)):
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if not n:
            return out


def _new_tag() -> str:
    """A unique name stem: this process's pid and a counter (names must fit 15 characters)."""
    with _counter_lock:
        return f"{PREFIX}{_base36(os.getpid())}x{_base36(next(_counter))}"


def netem_available() -> bool:
    """Whether this kernel has tc's ``netem`` qdisc (needed for ``Link.delay_ms``); needs root."""
    probe = _new_tag()
    _run("ip", "link", "add", f"{probe}p", "type", "veth", "peer", "name", f"{probe}q")
    try:
        return _run("tc", "qdisc", "add", "dev", f"{probe}p", "root", "netem", "delay", "1ms",
                    check=False).returncode == 0
    finally:
        _run("ip", "link", "del", f"{probe}p", check=False)  # takes its peer with it


def _free_subnet() -> ipaddress.IPv4Network:
    used = _run("ip", "-4", "-o", "addr", "show", check=False).stdout
    taken = {
        ipaddress.ip_interface(m).network.supernet(new_prefix=24)
        for m in re.findall(r"inet (\S+)", used)
        if ipaddress.ip_interface(m).ip in _SUPERNET
    }
    for net in _SUPERNET.subnets(new_prefix=24):
        if net.network_address.packed[2] >= 1 and net not in taken:
            return net  # type: ignore[return-value]
    raise HarnessUnavailable(f"no free /24 left in {_SUPERNET}: remove unused bridges")


def _python_path() -> str:
    """PYTHONPATH that makes the hosts import this very dask_train (a source checkout too)."""
    here = str(Path(__file__).resolve().parents[2])  # the directory holding dask_train/
    rest = os.environ.get("PYTHONPATH", "")
    return here + (os.pathsep + rest if rest else "")


class NetnsCluster:
    """A scheduler and ``n_workers`` worker hosts, each in its own network namespace.

    Parameters
    ----------
    n_workers : int
        Worker hosts; each runs one ``dask worker`` (``workers_per_host`` worker processes).
    link : Link
        Every host's link (the scheduler's too). Change one later with :meth:`set_link`.
    nthreads : int
        Dask threads per worker.
    memory_limit : str
        ``--memory-limit`` of each worker.
    dask : str, optional
        The ``dask`` program (default: the one beside this Python).
    start_timeout : float
        Seconds to wait for the scheduler and every worker.
    workers_per_host : int
        Dask worker processes on each host (``dask worker --nworkers``): processes of one host
        share its memory (``/dev/shm``), hosts only the network.

    Examples
    --------
    >>> with NetnsCluster(n_workers=4) as cluster:                  # doctest: +SKIP
    ...     client = Client(cluster.scheduler_address)
    ...     cluster.hosts[0].address, cluster.hosts[0].iface
    ('10.77.1.10', 'hnet0')
    """

    def __init__(
        self, n_workers: int = 4, *, link: Link | None = None, nthreads: int = 1,
        memory_limit: str = "1GiB", dask: str | None = None, start_timeout: float = 90.0,
        workers_per_host: int = 1,
    ) -> None:
        self.n_workers = n_workers
        self.workers_per_host = workers_per_host
        self.link = link or Link()
        self.nthreads = nthreads
        self.memory_limit = memory_limit
        self.dask = dask or str(Path(sys.executable).with_name("dask"))
        self.start_timeout = start_timeout
        if not (isinstance(n_workers, int) and 0 <= n_workers <= MAX_HOSTS):
            raise InvalidInput([f"n_workers={n_workers!r} is invalid: use an integer from 0 to "
                                f"{MAX_HOSTS}."])
        if not (isinstance(workers_per_host, int) and 1 <= workers_per_host <= 8):
            raise InvalidInput([f"workers_per_host={workers_per_host!r} is invalid: use an "
                                "integer from 1 to 8."])
        self.tag = _new_tag()
        self.bridge = f"{self.tag}b"
        self.scheduler: Host | None = None
        self.hosts: list[Host] = []
        self.links: dict[str, Link] = {}
        self.subnet: ipaddress.IPv4Network | None = None
        self.netem = False
        self._dir: Path | None = None
        self._closed = False

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> NetnsCluster:
        """Create the namespaces, links and shaping; start the scheduler and the workers."""
        reason = unavailable_reason()
        if reason:
            raise HarnessUnavailable(reason)
        cleanup_leftovers()
        atexit.register(self.close)
        self._dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        (self._dir / "dask.yaml").write_text(_WORKER_CONFIG)
        try:
            with open(_LOCK_PATH, "w") as lock:  # two clusters must not pick the same subnet
                fcntl.flock(lock, fcntl.LOCK_EX)
                self.subnet = _free_subnet()
                _run("ip", "link", "add", self.bridge, "type", "bridge")
                _run("ip", "addr", "add", f"{self._ip(1)}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            self.netem = netem_available()
            scheduler = self._add_host("scheduler", "s", self._ip(2), "snet")
            for i in range(self.n_workers):
                self._add_host(f"host-{i}", str(i), self._ip(10 + i), f"hnet{i}")
            for host in [scheduler, *self.hosts]:
                self.set_link(host, self.link)
            self._spawn(scheduler, [self.dask, "scheduler", "--host", scheduler.address,
                                    "--port", str(_SCHEDULER_PORT), "--no-dashboard"])
            self._wait_port(scheduler, _SCHEDULER_PORT)
            for host in self.hosts:
                self.start_worker(host)
            if self.n_workers:
                self._wait_workers(self.n_workers * self.workers_per_host)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process, delete the namespaces, the links and the bridge. Idempotent."""
        if self._closed:
            return
        self._closed = True
        hosts = [h for h in [*self.hosts, self.scheduler] if h is not None]
        for host in hosts:  # workers first: a clean goodbye to the scheduler
            for proc in host.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3
        for host in hosts:
            for proc in host.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.1, deadline - time.monotonic()))
        for host in hosts:
            _kill_netns(host.netns)  # children a nanny left behind, and anything still running
            for proc in host.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
            _run("ip", "netns", "del", host.netns, check=False)
            # The kernel frees a namespace (and the veth pair with it) only once nothing refers to
            # it any more, sometimes much later: delete our end of the pair now.
            _run("ip", "link", "del", host.outer, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- what a test or a benchmark does -------------------------------------------------------

    @property
    def scheduler_address(self) -> str:
        assert self.scheduler is not None, "start() the cluster first"
        return f"tcp://{self.scheduler.address}:{_SCHEDULER_PORT}"

    def host_of(self, worker_address: str) -> Host:
        """The host a Dask worker address belongs to."""
        ip = worker_host(worker_address)
        for host in [*self.hosts, *([self.scheduler] if self.scheduler else [])]:
            if host.address == ip:
                return host
        raise KeyError(f"{worker_address} is on none of this cluster's hosts")

    def kill_host(self, host: Host | int) -> list[int]:
        """SIGKILL every process in a host's namespace (its nanny and worker): the host is gone."""
        host = self.hosts[host] if isinstance(host, int) else host
        pids = _kill_netns(host.netns)
        for proc in host.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        host.procs = [p for p in host.procs if p.poll() is None]
        return pids

    def start_worker(self, host: Host | int) -> None:
        """Start (or start again, after :meth:`kill_host`) the ``dask worker`` of a host."""
        host = self.hosts[host] if isinstance(host, int) else host
        self._spawn(host, [
            self.dask, "worker", self.scheduler_address, "--host", host.address,
            "--nthreads", str(self.nthreads), "--nworkers", str(self.workers_per_host),
            "--memory-limit",
            self.memory_limit, "--name", host.name, "--no-dashboard", "--death-timeout", "60",
            "--local-directory", str(self._dir),
        ])

    def set_link(self, host: Host | int, link: Link) -> None:
        """Shape a host's link: the rate both ways, the delay on the way out."""
        host = self.hosts[host] if isinstance(host, int) else host
        if link.delay_ms and not self.netem:
            raise HarnessUnavailable(
                f"delay_ms={link.delay_ms:g} needs tc's netem qdisc, which this kernel lacks "
                "(no sch_netem module): use delay_ms=0 here, or a kernel with netem.")
        for dev, netns, out in ((host.iface, host.netns, True), (host.outer, None, False)):
            prefix = ["ip", "netns", "exec", netns] if netns else []
            _run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            args = _qdisc(link, outbound=out)
            if args:
                _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", *args)
        self.links[host.name] = link

    def logs(self, host: Host | int, tail: int = 40) -> str:
        """The last lines the host's processes wrote (for error messages)."""
        host = self.hosts[host] if isinstance(host, int) else host
        try:
            return "\n".join(host.log.read_text(errors="replace").splitlines()[-tail:])
        except OSError:
            return ""

    # -- internals -------------------------------------------------------------------------------

    def _ip(self, last: int) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + last)

    def _add_host(self, name: str, short: str, address: str, iface: str) -> Host:
        netns, outer, inner = f"{self.tag}-{short}", f"{self.tag}v{short}", f"{self.tag}n{short}"
        assert self._dir is not None
        host = Host(name=name, netns=netns, address=address, iface=iface, outer=outer,
                    log=self._dir / f"{name}.log")
        _run("ip", "netns", "add", netns)
        # Recorded at once: close() deletes what exists even when start() failed half-way.
        if name == "scheduler":
            self.scheduler = host
        else:
            self.hosts.append(host)
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", inner, "netns", netns)
        _run("ip", "link", "set", outer, "master", self.bridge, "up")
        ns = ("ip", "-n", netns)
        _run(*ns, "link", "set", inner, "name", iface)
        _run(*ns, "addr", "add", f"{address}/24", "dev", iface)
        _run(*ns, "link", "set", iface, "up")
        _run(*ns, "link", "set", "lo", "up")
        return host

    def _spawn(self, host: Host, argv: Sequence[str]) -> None:
        assert self._dir is not None
        env = {**os.environ, "PYTHONPATH": _python_path(), "DASK_CONFIG": str(self._dir),
               "PYTHONUNBUFFERED": "1"}
        env.pop("DASK_SCHEDULER_ADDRESS", None)
        with open(host.log, "ab") as log:
            # `ip netns exec` execs the program, so the Popen is the dask process itself; its own
            # session, so a Ctrl-C in the terminal reaches the harness first, which stops it.
            host.procs.append(subprocess.Popen(
                ["ip", "netns", "exec", host.netns, *argv], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, start_new_session=True))

    def _wait_port(self, host: Host, port: int) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in host.procs):
                break
            out = _run("ip", "netns", "exec", host.netns, "ss", "-ltn", check=False).stdout
            if f"{host.address}:{port}" in out:
                return
            time.sleep(0.2)
        raise HarnessUnavailable(f"{host.name} did not start listening on {port}:\n{self.logs(host)}")

    def _wait_workers(self, n: int) -> None:
        from distributed import Client

        from dask_train.runtime._calls import live_workers

        with Client(self.scheduler_address, timeout=self.start_timeout) as client:
            try:
                client.wait_for_workers(n, timeout=self.start_timeout)
            except TimeoutError:
                logs = "\n".join(f"--- {h.name}\n{self.logs(h, 15)}" for h in self.hosts)
                raise HarnessUnavailable(
                    f"only {len(live_workers(client))} of {n} workers joined within "
                    f"{self.start_timeout:g} s:\n{logs}") from None


def _qdisc(link: Link, *, outbound: bool) -> list[str]:
    """tc arguments for one direction of a link, or [] for none."""
    if link.delay_ms and outbound:
        args = ["netem", "delay", f"{link.delay_ms:g}ms", "limit", "100000"]
        return args + (["rate", f"{link.rate_mbit:g}mbit"] if link.rate_mbit else [])
    if link.rate_mbit is None:
        return []
    # Burst: one millisecond of traffic, at least a few full-size packets; the queue holds at most
    # 20 ms of traffic beyond it (TCP adapts to the rate instead of filling a deep buffer).
    burst = max(16_384, int(link.rate_mbit * 1e6 / 8 / 1000))
    return ["tbf", "rate", f"{link.rate_mbit:g}mbit", "burst", str(burst), "latency", "20ms"]


@contextlib.contextmanager
def netns_cluster(n_workers: int = 4, **kwargs: object) -> Iterator[NetnsCluster]:
    """``with netns_cluster(4, link=Link(1000)) as cluster:`` -- started, and closed on exit."""
    cluster = NetnsCluster(n_workers, **kwargs)  # type: ignore[arg-type]
    with cluster.start():
        yield cluster
