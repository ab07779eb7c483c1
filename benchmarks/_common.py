"""Helpers shared by the benchmarks: models, CPU-load accounting, environment notes and output."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask
import distributed
import psutil
import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def build_mlp(hidden: Sequence[int], *, n_in: int = 64, n_out: int = 10, seed: int = 0) -> torch.nn.Module:
    """A ReLU MLP ``n_in-hidden...-n_out`` with seeded initial weights."""
    torch.manual_seed(seed)
    dims = [n_in, *hidden, n_out]
    layers: list[torch.nn.Module] = []
    for d_in, d_out in zip(dims[:-1], dims[1:]):
        layers += [torch.nn.Linear(d_in, d_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


@dataclass
class CpuLoad:
    """CPU use over one measured interval, in cores (1.0 = one core busy the whole time)."""

    wall_s: float = math.nan
    machine: float = math.nan  # every process on the machine
    ours: float = math.nan  # this process and its descendants (the Dask cluster's processes)
    steal: float = math.nan  # time the hypervisor ran other machines on our virtual cores

    @property
    def foreign(self) -> float:
        """Cores used by processes that are not ours: anything above ~0.1 disturbs the timing."""
        return max(0.0, self.machine - self.ours)


def _busy_cpu_s() -> float:
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0) + getattr(times, "steal", 0.0)
    return sum(times) - idle - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)


def _our_cpu_s() -> float:
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # a process that ended meanwhile
            continue
        total += times.user + times.system
    return total


@contextmanager
def cpu_load() -> Iterator[CpuLoad]:
    """Measure machine-wide and our own CPU use over the ``with`` block."""
    load = CpuLoad()
    busy0, ours0, t0 = _busy_cpu_s(), _our_cpu_s(), time.perf_counter()
    steal0 = getattr(psutil.cpu_times(), "steal", 0.0)
    try:
        yield load
    finally:
        load.wall_s = time.perf_counter() - t0
        if load.wall_s > 0:
            load.machine = (_busy_cpu_s() - busy0) / load.wall_s
            load.ours = (_our_cpu_s() - ours0) / load.wall_s
            load.steal = (getattr(psutil.cpu_times(), "steal", 0.0) - steal0) / load.wall_s


def wait_for_quiet(*, max_wait_s: float, threshold: float = 0.1, probe_s: float = 0.5) -> float:
    """Wait until other programs use less than ``threshold`` cores; return the seconds waited.

    On a shared machine another job (a test run, a build) can take one of the cores for a while;
    starting a timed run then would measure that job, not ours. Gives up after ``max_wait_s``.
    """
    started = time.perf_counter()
    while time.perf_counter() - started < max_wait_s:
        with cpu_load() as load:
            time.sleep(probe_s)
        if load.foreign < threshold:
            break
    return time.perf_counter() - started


def environment() -> dict[str, Any]:
    """What the numbers depend on: cores, library versions, the machine's load when we started."""
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": _cpu_model(),
        "torch": torch.__version__,
        "torch_default_threads": torch.get_num_threads(),
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A GitHub markdown table of ``rows`` (dicts of already formatted cells) in ``columns``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_results(name: str, markdown: str, raw: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``results/<name>.md`` and ``results/<name>.json``; return both paths."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    md_path, json_path = RESULTS_DIR / f"{name}.md", RESULTS_DIR / f"{name}.json"
    md_path.write_text(markdown + "\n")
    json_path.write_text(json.dumps(_jsonable(raw), indent=2, allow_nan=False) + "\n")
    return md_path, json_path


def _jsonable(value: Any) -> Any:
    """Plain JSON values: numpy scalars unwrapped, NaN and infinities as null (strict JSON)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)
