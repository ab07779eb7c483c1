"""``dask-train launch`` against ``torchrun`` on one machine: script start to the first step,
and a kill's restart to the first step again.

Usage::

    python benchmarks/launch.py [--repeats 3]

Each run is a fresh command, as a user types it: ``torchrun --nproc-per-node 2 --max-restarts 1
bench_script.py`` and ``dask-train launch --workers 2 --max-restarts 1 bench_script.py`` (its
embedded cluster started by the command). The script (written here) is a DDP step loop on gloo
that records, per rank and attempt, the wall time of its first step. Rows:

* start: the command's start to rank 0's first step (imports, cluster, rendezvous, DDP);
* restart after the rank's program is killed: SIGKILL to rank 1's program (what torchrun's
  agent sees), to the first step of the restarted gang;
* restart after the rank's Dask worker is killed (launch only): SIGKILL to rank 1's worker
  process (its nanny starts a new one), to the first step of the restarted gang.

Medians and ranges over ``--repeats``; the machine's load average is recorded beside them.
Written to ``results/launch.md``; nothing is asserted. Aim (issue 56): the start within 1.1x
of torchrun's, a restart in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, markdown_table, write_results  # noqa: E402

SCRIPT = '''
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 64)
for step in range(int(sys.argv[1])):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if step == 0:
        with open("marks.jsonl", "a") as f:
            f.write(json.dumps({"rank": dist.get_rank(), "time": time.time(), "pid": os.getpid(),
                                "parent": os.getppid(),
                                "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}) + "\\n")
    time.sleep(0.05)
dist.destroy_process_group()
'''


def _marks(where: Path) -> list[dict]:
    path = where / "marks.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _mark(where: Path, *, rank: int, restart: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for mark in _marks(where):
            if mark["rank"] == rank and mark["restart"] == restart:
                return mark
        time.sleep(0.01)
    raise TimeoutError(f"no first step of rank {rank} at restart {restart} in {where}")


def one_run(launcher: str, kill: str) -> dict[str, float]:
    """One command: its start to the first step, then ``kill`` ("program" or "worker") rank 1
    and the time to the restarted gang's first step."""
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        (where / "bench_script.py").write_text(SCRIPT)
        steps = "200"  # 10 s of steps: the kill and the restart happen well inside
        if launcher == "torchrun":
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--max-restarts", "1", "bench_script.py", steps]
        else:
            command = [str(Path(sys.executable).parent / "dask-train"), "launch", "--workers",
                       "2", "--max-restarts", "1", "--quiet", "--log-dir", str(where / "logs"),
                       "bench_script.py", steps]
        started = time.time()
        # A session of its own: a launcher that hangs is ended with every process it started.
        proc = subprocess.Popen(command, cwd=where, stdout=subprocess.DEVNULL,
                                stderr=(where / "launcher.log").open("w"),
                                start_new_session=True)
        try:
            first = _mark(where, rank=0, restart=0)
            victim = _mark(where, rank=1, restart=0)
            killed = time.time()
            os.kill(victim["pid"] if kill == "program" else victim["parent"], signal.SIGKILL)
            try:
                again_s = _mark(where, rank=0, restart=1, timeout=45.0)["time"] - killed
            except TimeoutError:  # the restarted gang never stepped: said in the table
                again_s = math.nan
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30 if math.isnan(again_s) else 120)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return {"start_s": first["time"] - started, "restart_s": again_s,
                "rc": float(proc.returncode if proc.returncode is not None else -1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cases = [("torchrun", "program"), ("dask-train launch", "program"),
             ("dask-train launch", "worker")]
    runs: dict[str, list[dict[str, float]]] = {f"{a} / kill {k}": [] for a, k in cases}
    loads = []
    for _ in range(args.repeats):  # interleaved: a load change hits every case alike
        for launcher, kill in cases:
            loads.append(os.getloadavg()[0])
            got = one_run(launcher, kill)
            print(launcher, kill, got, flush=True)
            runs[f"{launcher} / kill {kill}"].append(got)
    rows = []
    base = statistics.median(r["start_s"] for r in runs["torchrun / kill program"])
    for name, got in runs.items():
        start = [r["start_s"] for r in got]
        restart = [r["restart_s"] for r in got if not math.isnan(r["restart_s"])] or [math.nan]
        failed = sum(math.isnan(r["restart_s"]) for r in got)
        rows.append({
            "case": name,
            "start to first step, s": f"{statistics.median(start):.2f} "
                                      f"({min(start):.2f}-{max(start):.2f})",
            "vs torchrun": f"{statistics.median(start) / base:.2f}x",
            "kill to first step again, s": f"{statistics.median(restart):.2f} "
                                           f"({min(restart):.2f}-{max(restart):.2f})"
                                           + (f"; {failed} never stepped again" if failed else ""),
            "exit codes": ",".join(str(int(r["rc"])) for r in got)})
    table = markdown_table(rows, list(rows[0]))
    note = (f"\n{args.repeats} runs each, interleaved; load average (1 min) before the runs "
            f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores.\n")
    print(table + note)
    write_results("launch", table + note, {"runs": runs, "loads": loads,
                                            "environment": environment()})


if __name__ == "__main__":
    main()
