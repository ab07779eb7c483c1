"""Which device each Dask worker trains on: ``Trainer(device="auto" | "cpu" | "cuda" | "cuda:N")``.

One GPU per Dask worker is the convention (dask-cuda's ``LocalCUDACluster`` starts one worker per
GPU and sets ``CUDA_VISIBLE_DEVICES`` so that each sees its own GPU first, as ``cuda:0``). Workers
that share a host and see several GPUs take one each, by their position among the workers on that
host, as :func:`dask_train.start_torch` does for NCCL ranks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distributed import Client

from dask_train.errors import InvalidInput
from dask_train.runtime._hosts import worker_host

#: Device files of a GPU that torch.cuda can use on Linux: NVIDIA's driver, AMD's (ROCm builds of
#: torch answer through torch.cuda), WSL2's GPU paravirtualization.
_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def _no_gpu_here() -> bool:
    """Whether this machine certainly has no GPU torch.cuda could use: Linux without any GPU
    device file, or macOS (no CUDA build)."""
    if sys.platform == "darwin":
        return True
    return sys.platform.startswith("linux") and not any(
        os.path.exists(p) for p in _GPU_DEVICE_FILES)


def _cuda_info() -> dict[str, Any]:
    """Run on a worker: its visible CUDA devices and whether they compute in bfloat16.

    Without a GPU device file no torch import is needed to say so: it runs on the worker's
    event loop, where importing torch (1-2 s while the worker's preload imports it too) held
    every message to that worker, a fit's data among them.
    """
    if _no_gpu_here():
        return {"cuda": 0, "bf16": False}
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"cuda": count, "bf16": bool(count and torch.cuda.is_bf16_supported())}


@dataclass
class Devices:
    """The job's device choice: ``kind`` ("cpu" or "cuda"), the device of each worker known at
    the start (a worker not listed, one that joined later, uses the current CUDA device), and the
    autocast precision (None, "bf16" or "fp16")."""

    kind: str = "cpu"
    by_worker: dict[str, str] = field(default_factory=dict)
    precision: str | None = None


def group_backend(kind: str, devices: Mapping[str, str], ranks: Sequence[str]) -> str:
    """The torch process group's backend for ranks on ``ranks``: NCCL for a CUDA job whose ranks
    each have a GPU of their own, else gloo.

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); gloo all-reduces CUDA tensors
    through host memory, so more Dask workers than GPUs on a host (two ranks sharing one GPU)
    still train, slower. ``devices`` maps the cluster's workers to the devices chosen for them
    (:func:`assign_devices`): a host has as many GPUs as it has distinct devices there.

    Examples
    --------
    >>> group_backend("cuda", {"tcp://a:1": "cuda:0", "tcp://a:2": "cuda:1"}, ["tcp://a:1", "tcp://a:2"])
    'nccl'
    >>> group_backend("cuda", {"tcp://a:1": "cuda:0", "tcp://a:2": "cuda:0"}, ["tcp://a:1", "tcp://a:2"])
    'gloo'
    """
    if kind != "cuda":
        return "gloo"
    gpus: dict[str, set[str]] = {}
    for address, device in devices.items():
        gpus.setdefault(worker_host(address), set()).add(device)
    ranks_on: dict[str, int] = {}
    for address in ranks:
        ranks_on[worker_host(address)] = ranks_on.get(worker_host(address), 0) + 1
    shared = any(n > max(1, len(gpus.get(host, ()))) for host, n in ranks_on.items())
    return "gloo" if shared else "nccl"


def assign_devices(requested: str, info: Mapping[str, Mapping[str, Any]], *,
                   mixed_precision: Any = False) -> Devices:
    """Resolve ``device=`` and ``mixed_precision=`` over the workers' CUDA ``info`` (pure).

    Examples
    --------
    >>> assign_devices("auto", {"tcp://a:1": {"cuda": 0, "bf16": False}}).kind
    'cpu'
    >>> assign_devices("auto", {"tcp://a:1": {"cuda": 2, "bf16": True},
    ...                         "tcp://a:2": {"cuda": 2, "bf16": True}}).by_worker
    {'tcp://a:1': 'cuda:0', 'tcp://a:2': 'cuda:1'}
    """
    without = sorted(a for a, i in info.items() if not i.get("cuda"))
    if requested == "cpu" or (requested == "auto" and (without or not info)):
        kind = "cpu"
    elif without:
        raise InvalidInput([
            f"device={requested!r} but the Dask workers {without} have no CUDA device: use "
            "device='auto' (the CPU unless every worker has a GPU) or 'cpu', or run the job on "
            "GPU workers (dask-cuda's LocalCUDACluster starts one per GPU)."
        ])
    else:
        kind = "cuda"
    by_worker: dict[str, str] = {}
    if kind == "cuda":
        position: dict[str, int] = {}
        for address in sorted(info):
            index = position.get(worker_host(address), 0)
            position[worker_host(address)] = index + 1
            fixed = requested.split(":", 1)[1] if requested.startswith("cuda:") else None
            by_worker[address] = f"cuda:{fixed if fixed is not None else index % info[address]['cuda']}"
    precision = None
    if mixed_precision is True:
        bf16 = kind == "cpu" or all(bool(info[a].get("bf16")) for a in by_worker)
        precision = "bf16" if bf16 else "fp16"
    elif mixed_precision in ("bf16", "fp16"):
        precision = str(mixed_precision)
    return Devices(kind, by_worker, precision)


def probe_devices(client: Client, requested: str, *, mixed_precision: Any = False,
                  workers: Collection[str] | None = None) -> Devices:
    """Ask every worker for its CUDA devices (unless ``requested`` is "cpu") and resolve them.

    ``workers``: only those (the ones that may hold a trainer, with ``resources=``): a GPU
    cluster's CPU workers, which run only servers and the scorer, then leave "auto" the GPU.
    """
    if requested == "cpu":
        return assign_devices("cpu", {}, mixed_precision=mixed_precision)
    info: dict[str, dict[str, Any]] = client.run(
        _cuda_info, workers=sorted(workers) if workers is not None else None)
    return assign_devices(requested, info, mixed_precision=mixed_precision)
