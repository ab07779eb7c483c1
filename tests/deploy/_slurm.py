"""A real one-node Slurm for tests: Debian's ``slurm-wlm`` and ``munge``, started in a directory.

:func:`slurm` writes a minimal ``slurm.conf`` (one node, this machine, one partition), starts a
private ``munged`` (its own key and socket, so a system one is left alone), ``slurmctld`` and
``slurmd`` in the foreground as child processes, sets ``SLURM_CONF`` so ``sbatch``, ``squeue`` and
``scancel`` (and dask-jobqueue, which calls them) reach it, waits until ``sinfo`` shows the node
idle, and at the end cancels what is left in the queue and stops everything. Every file it writes
(state, spool, logs, job output) stays in that directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "sinfo")
INSTALL = "make dev installs it: apt-get install slurmctld slurmd slurm-client munge"


def _which(name: str) -> str | None:
    # The daemons are in /usr/sbin, which a user's PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")


def slurm_available() -> str | None:
    """None when this machine can run :func:`slurm`, else why not (a reason to skip)."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if missing:
        return f"Slurm is not installed on this machine ({INSTALL}): no {', '.join(missing)}"
    if os.geteuid() != 0:
        # slurmd starts each job as its user, and the configuration names root as SlurmUser.
        return "Slurm's daemons need root here (slurmd runs the jobs), and this is not root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _memory_mb() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20)


def write_conf(root: Path, *, cpus: int = 2) -> Path:
    """A one-node ``slurm.conf`` in ``root``: this host (by its short name, at 127.0.0.1) with
    ``cpus`` CPUs (whatever it has: ``config_overrides`` keeps a smaller machine from being
    drained), free ports, no cgroups (``proctrack/linuxproc``, ``task/none``), no accounting,
    munge on the private socket ``root/munge/munge.sock``. Returns its path."""
    host = socket.gethostname().split(".")[0]
    for name in ("state", "spool", "munge"):
        (root / name).mkdir(exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=dasktrain",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge' / 'munge.sock'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "KillWait=5",  # SIGTERM at the walltime, SIGKILL 5 s later
        "MinJobAge=30",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={max(4096, _memory_mb())} "
        "State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))
    return conf


def _run(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, timeout=30).stdout


def _tail(root: Path, lines: int = 20) -> str:
    out = []
    for name in ("munged.log", "slurmctld.log", "slurmd.log"):
        path = root / name
        if path.exists():
            out.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-lines:]))
    return "\n".join(out)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _cancel_all(timeout: float = 30) -> None:
    """Cancels every job of this (private) cluster and waits until the queue is empty, so no
    ``slurmstepd`` outlives ``slurmd``."""
    jobs = _run("squeue", "-h", "-o", "%i").split()
    if jobs:
        _run("scancel", *jobs)
    deadline = time.monotonic() + timeout
    while _run("squeue", "-h", "-o", "%i").split() and time.monotonic() < deadline:
        time.sleep(0.5)


@contextmanager
def slurm(root: Path, *, timeout: float = 60) -> Iterator[Path]:
    """Runs munge, ``slurmctld`` and ``slurmd`` for one node in ``root`` (an empty directory)
    and yields the ``slurm.conf``; ``SLURM_CONF`` names it meanwhile. Raises RuntimeError, with
    the daemons' logs, if the node is not idle within ``timeout`` seconds."""
    # Three one-core jobs at once at the least (tests/deploy/test_slurm.py runs its walltime
    # test's first job beside the lifetime test's two), on a machine of two cores too.
    conf = write_conf(root, cpus=max(4, os.cpu_count() or 1))
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    # munged wants its socket's directory open to all (0755); the pytest directories above it
    # are 0700, which it accepts with --force (as a warning).
    (root / "munge").chmod(0o755)
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    out = (root / "daemons.out").open("wb")
    with ExitStack() as stack:
        stack.callback(out.close)
        stack.callback(lambda: os.environ.__setitem__("SLURM_CONF", before) if before is not None
                       else os.environ.pop("SLURM_CONF", None))
        munged = subprocess.Popen(
            [str(_which("munged")), "--foreground", "--force", f"--socket={root / 'munge' / 'munge.sock'}",
             f"--key-file={key}", f"--log-file={root / 'munged.log'}",
             f"--pid-file={root / 'munged.pid'}", f"--seed-file={root / 'munged.seed'}"],
            stdout=out, stderr=out)
        stack.callback(_stop, munged)
        deadline = time.monotonic() + timeout
        while not (root / "munge" / "munge.sock").exists():
            if munged.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start (exit {munged.poll()})\n{_tail(root)}")
            time.sleep(0.05)
        # -i: start even without the state files of an earlier run (there are none).
        slurmctld = subprocess.Popen([str(_which("slurmctld")), "-D", "-i"], stdout=out, stderr=out)
        stack.callback(_stop, slurmctld)
        slurmd = subprocess.Popen([str(_which("slurmd")), "-D"], stdout=out, stderr=out)
        stack.callback(_stop, slurmd)
        stack.callback(_cancel_all)  # runs first: the jobs end before the daemons
        state = ""
        while state != "idle":
            for name, process in (("slurmctld", slurmctld), ("slurmd", slurmd)):
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited ({process.returncode})\n"
                                       f"{(root / 'daemons.out').read_text()}\n{_tail(root)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm node is not idle after {timeout:.0f} s "
                                   f"(sinfo: {state!r})\n{_tail(root)}")
            time.sleep(0.25)
            state = _run("sinfo", "-h", "-N", "-o", "%T").strip()
        yield conf
