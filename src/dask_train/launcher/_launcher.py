"""``dt.launch``: a torchrun script on a Dask cluster, one rank per worker, as a gang that
restarts whole.

Each attempt places one :func:`~dask_train.launcher._rank.launch_rank` task per worker (pinned, as
every role is), with torchrun's environment; the program's output comes back on the run's
event topic and is printed and kept in the run's directory as it arrives. The attempt ends when
every rank returned 0 (done), a rank failed or its worker was lost (a restart that counts
against ``max_restarts``), or a worker gave notice (it is leaving: the ranks get SIGTERM and
``grace`` seconds, and the restart does not count). Ctrl-C stops every rank the same way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dask_train.errors import InvalidInput
from dask_train.launcher._job import LaunchJob
from dask_train.launcher._output import Output
from dask_train.launcher._rank import Program, forget_run, launch_rank, master_port, stop_ranks
from dask_train.runtime._hosts import local_ranks, worker_host

if TYPE_CHECKING:
    from distributed import Client

logger = logging.getLogger(__name__)

#: How often the launcher looks at its ranks and the cluster.
POLL_S = 0.05
#: How long a failed rank's exit waits for a lost worker that may have caused it to show.
FAILED_LOOK_S = 0.3
#: How long a finished rank's last output may take to arrive after its task's result.
LAST_OUTPUT_S = 2.0
#: Ctrl-C's grace: the programs get SIGTERM, then SIGKILL after this (never more than ``grace``).
INTERRUPT_GRACE_S = 3.0


@dataclass
class LaunchResult:
    """How a ``dt.launch`` run ended.

    Attributes
    ----------
    exit_code : int
        0 when every rank's program returned 0; else the failing rank's exit status (128 + N
        for a program ended by signal N; 1 for a lost worker), as ``dask-train launch`` exits.
    restarts : int
        Restarts that counted against ``max_restarts`` (a failed rank, a lost worker).
    attempts : int
        Gangs started, notice restarts included (``TORCHELASTIC_RESTART_COUNT`` of the last is
        ``attempts - 1``).
    failure : str
        What ended the run, "" when it succeeded.
    ranks : list of dict
        Each rank of the last attempt: rank, worker, pid, exit code, seconds.
    log_dir : pathlib.Path
        The run's directory: ``attempt_<n>/<rank>/stdout.log`` and ``stderr.log``, and
        ``summary.json``.
    wall_s : float
        Seconds from the call to the end.
    """

    exit_code: int
    restarts: int
    attempts: int
    failure: str
    ranks: list[dict[str, Any]]
    log_dir: Path
    wall_s: float
    history: list[dict[str, Any]] = field(default_factory=list)


def launch(target: str | Path, args: Sequence[Any] = (), *, module: bool = False,
           workers: int | tuple[int, int] | None = None, max_restarts: int = 0,
           client: Client | None = None, scheduler: str | None = None, timeout: float = 120.0,
           grace: float = 10.0, include: Sequence[str] = (), ship: bool | None = None,
           log_dir: str | Path | None = None, run_id: str | None = None,
           echo: bool = True, resources: Mapping[str, float] | None = None) -> LaunchResult:
    """Run a torchrun script on one rank per Dask worker, as ``torchrun script.py args`` would.

    Parameters
    ----------
    target : str or Path
        The script, or with ``module=True`` a module name (``python -m``).
    args : sequence of str
        The program's arguments (its ``sys.argv[1:]``).
    module : bool
        ``target`` is a module.
    workers : int or (int, int), optional
        Ranks, one per Dask worker (torchrun's nodes times processes per node), or ``(least,
        most)``: the gang starts once ``least`` workers are there and takes up to ``most``,
        workers that joined at its next restart. Default: every worker.
    max_restarts : int
        Restarts of the whole gang after a failed rank or a lost worker, as torchrun's
        ``--max-restarts``; a worker leaving with notice restarts it without counting.
    client : distributed.Client, optional
        The cluster; by default ``scheduler``'s, or the current client, or an embedded local
        cluster with ``most`` workers.
    scheduler : str, optional
        A scheduler's address (a cluster started elsewhere).
    timeout : float
        Longest wait for the workers a gang needs, in seconds.
    grace : float
        Seconds between a program's SIGTERM (its worker leaving, the gang stopping) and SIGKILL.
    include : sequence of str
        Files or directories under the program's directory that travel with its ``.py`` files.
    ship : bool, optional
        Send the program's directory to the workers and run it there (a cluster on other
        machines); default: when ``scheduler`` is given. Without, every rank runs the program
        in place, in this working directory (the embedded cluster; a shared file system).
    log_dir : str or Path, optional
        The run's directory; default ``runs/launch-<time>-<id>``.
    run_id : str, optional
        ``TORCHELASTIC_RUN_ID``; default a new one.
    echo : bool
        Print every rank's lines here as they come (``[rank1]: ...``); they are kept in
        ``log_dir`` either way.
    resources : mapping of str to number, optional
        Dask worker resources each rank holds while it runs (``{"GPU": 1}``): ranks go only to
        workers started with them (``dask worker --resources GPU=1``), as for ``dt.run``;
        refused before anything runs when too few workers have them free.

    Returns
    -------
    LaunchResult

    Raises
    ------
    InvalidInput
        Every problem with the arguments, before anything is sent to the cluster.
    KeyboardInterrupt
        After Ctrl-C, once every rank's program has ended.

    Examples
    --------
    >>> result = dt.launch("train.py", ["--epochs", "5"], workers=2, max_restarts=3)  # doctest: +SKIP
    >>> result.exit_code                                                               # doctest: +SKIP
    0
    """
    started = time.time()
    job = LaunchJob.of(target, args, module=module, workers=workers, max_restarts=max_restarts,
                       timeout=timeout, grace=grace, include=include,
                       ship=bool(scheduler) if ship is None else ship, log_dir=log_dir,
                       run_id=run_id, resources=resources)
    problems = job.problems()
    if problems:
        raise InvalidInput(problems)
    try:
        program = job.program()
    except ValueError as exc:
        raise InvalidInput([str(exc)]) from None
    with _connected(client, scheduler, job) as connected:
        result = Gang(connected, job, program, echo=echo).run()
    result.wall_s = time.time() - started
    return result


@contextlib.contextmanager
def _connected(client: Client | None, scheduler: str | None, job: LaunchJob) -> Iterator[Client]:
    """The run's client; one made here (``scheduler``'s, or an embedded cluster of as many
    workers as the gang takes at most) is closed at the end."""
    from dask_train.runtime import connect
    from dask_train.runtime._roles import ensure_plugin
    from dask_train.runtime._versions import check_once

    if client is None and scheduler is None:
        from distributed import default_client

        with contextlib.suppress(ValueError):  # no current client: an embedded cluster
            client = default_client()
    if client is not None:
        client = check_once(client)
        ensure_plugin(client)
        _check_room(client, job)
        yield client
        return
    workers = job.cluster.workers
    n = None if scheduler else (workers[1] if isinstance(workers, tuple) else workers)
    made = connect(scheduler, n_workers=n, dashboard=False, quiet=True)
    try:
        _check_room(made, job)
        yield made
    finally:
        made.close()


def _check_room(client: Client, job: LaunchJob) -> None:
    """Refuse a run with ``resources=`` whose least gang the workers with them cannot hold now,
    before any rank starts (a rank holds its worker's resources: one rank a worker)."""
    placement = job.cluster.placement
    if not placement:
        return
    from dask_train.runtime._roles import check_room, worker_threads

    least, _ = job.cluster.bounds(len(worker_threads(client)))
    check_room(client, placement, need=least, what=f"workers={job.cluster.workers!r}",
               one_per_worker=True)


@dataclass
class _Attempt:
    """One gang: its ranks' workers and tasks, and what became of them."""

    number: int
    workers: list[str]
    futures: list[Any]
    exits: dict[int, dict[str, Any]] = field(default_factory=dict)

    def code(self, rank: int) -> int | None:
        got = self.exits.get(rank)
        return None if got is None else int(got["exit"])


class Gang:
    """The launcher of one run (see the module docstring)."""

    def __init__(self, client: Client, job: LaunchJob, program: Program, *, echo: bool) -> None:
        self.client, self.job, self.program = client, job, program
        self.topic = f"dask-train-launch-{job.run_id}"
        # Where a leaving worker announces itself to the jobs it serves (runtime._plugin).
        self.notice_topic = f"dask-train-{job.run_id}"
        self.output = Output(job.log_dir, echo=echo)
        self.noticed: set[str] = set()
        self.lock = threading.Lock()
        self.history: list[dict[str, Any]] = []
        self.attempt: _Attempt | None = None  # the newest, from before its ranks are submitted

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> LaunchResult:
        """Attempt after attempt until one ends the run (see the module docstring)."""
        self.job.log_dir.mkdir(parents=True, exist_ok=True)
        self.client.subscribe_topic(self.topic, self.output.on_event)
        self.client.subscribe_topic(self.notice_topic, self._on_notice)
        restarts, number = 0, 0
        attempt: _Attempt | None = None
        try:
            while True:
                lost = len(attempt.workers) if attempt is not None and \
                    self.history[-1]["ended"] == "lost" else 0
                attempt = self._start(number, restarts=restarts, size=lost)
                ended, why = self._watch(attempt)
                self._stop(attempt, grace=float(self.job.grace))
                self.history.append({"attempt": number, "workers": attempt.workers,
                                     "ended": ended, "why": why})
                if ended == "done":
                    return self._result(attempt, 0, restarts, "")
                if ended == "notice":
                    logger.warning("%s: the gang restarts without them (not counted against "
                                   "max_restarts)", why)
                    self._say(f"{why}; restarting the gang (not counted against "
                              "--max-restarts)")
                else:
                    restarts += 1
                    if restarts > int(self.job.max_restarts):
                        code = self._exit_code(attempt, ended)
                        self._say(f"{why}; no restart left (--max-restarts "
                                  f"{self.job.max_restarts}): exit status {code}")
                        return self._result(attempt, code, restarts - 1, why)
                    self._say(f"{why}; restarting the gang (restart {restarts} of "
                              f"{self.job.max_restarts})")
                number += 1
        except KeyboardInterrupt:
            if self.attempt is not None:  # the one being started, too
                self._say("interrupted: stopping every rank")
                self._stop(self.attempt, grace=min(INTERRUPT_GRACE_S, float(self.job.grace)))
            raise
        finally:
            self._close()

    def _say(self, text: str) -> None:
        print(f"dask-train launch: {text}", file=sys.stderr, flush=True)

    def _start(self, number: int, *, restarts: int, size: int) -> _Attempt:
        """Place one rank per worker (waiting for the least the gang needs, see
        :meth:`_placement` for ``size``) and start them."""
        workers = self._placement(size=size)
        ranks = len(workers)
        hosts = list(dict.fromkeys(worker_host(address) for address in workers))
        local = local_ranks(workers)
        per_host = {h: sum(worker_host(w) == h for w in workers) for h in hosts}
        # rank 0's worker picks the port its program's env:// store binds.
        port = self.client.run(master_port, workers=[workers[0]])[workers[0]]
        master = worker_host(workers[0])
        futures: list[Any] = []
        # Known before its first task is submitted: Ctrl-C from here on stops its ranks.
        self.attempt = _Attempt(number=number, workers=workers, futures=futures)
        for rank, address in enumerate(workers):
            host = worker_host(address)
            env = {"RANK": str(rank), "LOCAL_RANK": str(local[rank]), "WORLD_SIZE": str(ranks),
                   "LOCAL_WORLD_SIZE": str(per_host[host]), "GROUP_RANK": str(hosts.index(host)),
                   "GROUP_WORLD_SIZE": str(len(hosts)), "ROLE_RANK": str(rank),
                   "ROLE_WORLD_SIZE": str(ranks), "ROLE_NAME": "default",
                   "MASTER_ADDR": master, "MASTER_PORT": str(port),
                   "TORCHELASTIC_RUN_ID": self.job.run_id,
                   "TORCHELASTIC_RESTART_COUNT": str(number),
                   "TORCHELASTIC_MAX_RESTARTS": str(self.job.max_restarts),
                   "TORCHELASTIC_USE_AGENT_STORE": "False"}
            # pure=False: every attempt runs the program again; pinned: one rank per worker.
            futures.append(self.client.submit(
                launch_rank, self.program, env, run_id=self.job.run_id, rank=rank,
                attempt=number, topic=self.topic, workers=[address], allow_other_workers=False,
                pure=False, key=f"dt-launch-{self.job.run_id}-a{number}-r{rank}",
                resources=self.job.cluster.placement.task_resources))
        logger.info("attempt %d: %d ranks on %s (restarts counted so far: %d)", number, ranks,
                    workers, restarts)
        return self.attempt

    def _placement(self, *, size: int = 0) -> list[str]:
        """The workers of the next gang, rank order: by host, then address (a host's ranks
        together, as torchrun numbers a node's; the same workers get the same ranks again).

        After a loss, ``size`` is the gang's size before it: up to 10 s are given for the
        cluster to get back to it (a nanny restarts a killed worker in 1-7 s), so that a
        ``MIN:MAX`` gang does not restart smaller only to restart again."""
        deadline = time.monotonic() + float(self.job.cluster.timeout)
        back_by = time.monotonic() + min(10.0, float(self.job.cluster.timeout))
        said = False
        while True:
            alive = self._alive(placeable=True)
            alive = [a for a in alive if a not in self.noticed and self._fits(a)]
            least, most = self.job.cluster.bounds(len(alive))
            if len(alive) >= least and (len(alive) >= min(size, most) or
                                        time.monotonic() > back_by):
                ordered = sorted(alive, key=lambda a: (worker_host(a), a))
                return ordered[:most]
            if time.monotonic() > deadline:
                raise InvalidInput([f"workers={self.job.cluster.workers!r}: {least} Dask workers "
                                    f"are needed but the cluster has {len(alive)} after "
                                    f"{self.job.cluster.timeout:g} s: add workers, or ask for "
                                    "fewer ranks."])
            if not said:
                said = True
                logger.info("waiting for %d workers (%d now)", least, len(alive))
            time.sleep(0.2)

    def _fits(self, address: str) -> bool:
        """Whether a rank may run on the worker at ``address`` (it has the run's resources)."""
        from dask_train.runtime._roles import can_hold

        return can_hold(self.client, self.job.cluster.placement, address)

    def _alive(self, *, placeable: bool = False) -> list[str]:
        from dask_train.runtime._calls import alive_workers

        return list(self.client.sync(alive_workers, self.client, placeable=placeable))

    def _on_notice(self, event: Any) -> None:
        """A worker of the run is leaving with notice (runtime._plugin's hold): keep it while
        its rank stops."""
        msg = event[1] if isinstance(event, tuple) else event
        if msg.get("kind") == "leaving":
            with self.lock:
                self.noticed.add(str(msg["address"]))

    # -- watching ---------------------------------------------------------------------------------
    def _watch(self, attempt: _Attempt) -> tuple[str, str]:
        """Until the attempt ends: ("done" | "failed" | "lost" | "notice", why)."""
        next_look = 0.0
        failed_at: float | None = None
        while True:
            self._collect(attempt)
            with self.lock:
                noticed = [w for w in attempt.workers if w in self.noticed]
            if noticed:
                self._hold(noticed)
                return "notice", f"{', '.join(noticed)} is leaving with notice"
            now = time.monotonic()
            if now >= next_look:
                next_look = now + 0.5
                alive = set(self._alive())
                gone = [(i, w) for i, w in enumerate(attempt.workers) if w not in alive]
                if gone:
                    i, w = gone[0]
                    return "lost", f"rank {i}'s worker {w} left the cluster"
            bad = [i for i in attempt.exits if attempt.code(i) != 0]
            if bad:
                # A peer's loss shows as a failed rank first (its collective broke): look at
                # the cluster at once and a moment longer (the scheduler removes a killed
                # worker within milliseconds, more under load) before blaming the rank.
                if failed_at is None:
                    failed_at, next_look = now, now
                    continue
                if now - failed_at > FAILED_LOOK_S or len(bad) == len(attempt.workers):
                    first = _first_failure(attempt.exits, bad)
                    got = attempt.exits[first]
                    return "failed", (
                        f"rank {first} (worker {got['worker']}, pid {got.get('pid')}) exited "
                        f"with {_status(int(got['exit']))}; its traceback is above and in "
                        f"{self.output.path(attempt.number, first, 'stderr')}")
                next_look = min(next_look, now + 0.1)
            elif len(attempt.exits) == len(attempt.workers):
                self._last_output(attempt)
                return "done", ""
            time.sleep(POLL_S)

    def _collect(self, attempt: _Attempt) -> None:
        """Each finished rank's exit (a task that raised counts as exit 1, its error said)."""
        for i, fut in enumerate(attempt.futures):
            if i in attempt.exits or fut.status not in ("finished", "error"):
                continue
            if fut.status == "finished":
                got = dict(fut.result())
            else:
                exc = fut.exception()
                self._say(f"rank {i}'s task on {attempt.workers[i]} failed: "
                          f"{type(exc).__name__}: {exc}")
                got = {"exit": 1, "worker": attempt.workers[i]}
            got["order"] = len(attempt.exits)
            attempt.exits[i] = got

    def _last_output(self, attempt: _Attempt) -> None:
        """Wait (briefly) for every finished rank's last lines: they come on the event topic,
        apart from the task's result."""
        deadline = time.monotonic() + LAST_OUTPUT_S
        while time.monotonic() < deadline:
            with self.output.lock:
                if all((attempt.number, i) in self.output.ended for i in attempt.exits):
                    return
            time.sleep(0.02)

    def _hold(self, workers: list[str]) -> None:
        """Tell leaving ``workers`` their notice was heard: they wait for their ranks to end."""
        from dask_train.runtime._calls import run_on_live
        from dask_train.runtime._plugin import heard_leaving

        self.client.sync(run_on_live, self.client, heard_leaving, workers=workers,
                         leaving=workers)

    # -- ending -----------------------------------------------------------------------------------
    def _stop(self, attempt: _Attempt, *, grace: float) -> None:
        """SIGTERM to every rank's program still running, SIGKILL after ``grace``; wait until
        each has ended (or its worker is gone), then let its task go."""
        from dask_train.runtime._calls import run_on_live

        running = [w for i, w in enumerate(attempt.workers) if i not in attempt.exits]
        if running:
            with self.lock:
                leaving = sorted(self.noticed)
            self.client.sync(run_on_live, self.client, stop_ranks, self.job.run_id,
                             attempt.number, grace, workers=sorted(set(running)),
                             leaving=leaving)
        deadline = time.monotonic() + grace + 10.0
        while time.monotonic() < deadline:
            self._collect(attempt)
            alive = set(self._alive())
            waiting = [i for i, w in enumerate(attempt.workers)
                       if i not in attempt.exits and (w in alive or w in self.noticed)
                       and (attempt.number, i) not in self.output.ended]
            if not waiting:
                break
            time.sleep(POLL_S)
        else:
            logger.warning("ranks %s of attempt %d did not end within %g s of SIGKILL",
                           waiting, attempt.number, grace + 10.0)
        self._last_output(attempt)
        # A rank whose worker died waits in no-worker forever: cancel them all.
        self.client.cancel(attempt.futures)

    def _exit_code(self, attempt: _Attempt, ended: str) -> int:
        if ended == "failed":
            bad = [i for i in attempt.exits if attempt.code(i) != 0]
            first = _first_failure(attempt.exits, bad)
            return _shell_status(int(attempt.exits[first]["exit"]))
        return 1

    def _result(self, attempt: _Attempt, code: int, restarts: int, failure: str) -> LaunchResult:
        ranks = [{"rank": i, "worker": w, **{k: v for k, v in attempt.exits.get(i, {}).items()
                                             if k in ("exit", "pid", "seconds")}}
                 for i, w in enumerate(attempt.workers)]
        result = LaunchResult(exit_code=code, restarts=restarts, attempts=attempt.number + 1,
                              failure=failure, ranks=ranks, log_dir=self.job.log_dir,
                              wall_s=0.0, history=self.history)
        summary = {"exit_code": code, "restarts": restarts, "attempts": attempt.number + 1,
                   "failure": failure, "ranks": ranks, "run_id": self.job.run_id,
                   "history": self.history}
        (self.job.log_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return result

    def _close(self) -> None:
        from dask_train.runtime._calls import run_on_live
        from dask_train.runtime._compat import drop_topic_handler

        with contextlib.suppress(Exception):  # the workers keep nothing of the run
            self.client.sync(run_on_live, self.client, forget_run, self.job.run_id,
                             workers=self._alive())

        for topic in (self.topic, self.notice_topic):
            with contextlib.suppress(Exception):
                self.client.unsubscribe_topic(topic)
            drop_topic_handler(self.client, topic)
        self.output.close()


def _first_failure(exits: Mapping[int, Mapping[str, Any]], bad: Iterable[int]) -> int:
    """The failed rank to blame: one that failed for its own reason before one whose
    collective broke because a peer ended (its stderr said so), then the one whose program
    ended first (on its worker's clock), then the first whose answer came.

    Answers alone misled: a rank that raised exits through Python's teardown, and its peer,
    aborted by gloo on the closed connection (SIGABRT), answered first once in a suite run;
    the launcher then exited 134 for a job whose cause was the other rank's exit code 7."""
    return min(bad, key=lambda i: (bool(exits[i].get("peer_gone")),
                                   float(exits[i].get("ended", float("inf"))),
                                   int(exits[i]["order"])))


def _status(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _shell_status(code: int) -> int:
    """A program's exit as a shell reports it: 128 + N after signal N."""
    return 128 - code if code < 0 else code
