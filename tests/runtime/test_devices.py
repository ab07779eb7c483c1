"""The device probe: where no GPU can be, the workers say so without importing torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from distributed import Client

from dask_train.runtime._devices import _GPU_DEVICE_FILES, _no_gpu_here, probe_devices

_PROBE = (
    "import json, sys\n"
    "from dask_train.runtime._devices import _cuda_info\n"
    "info = _cuda_info()\n"
    "print(json.dumps([info, 'torch' in sys.modules]))\n"
)


def test_a_machine_without_gpu_device_files_is_answered_without_torch() -> None:
    """The probe runs on each worker's event loop: importing torch there (1-2 s) held every
    message to the worker. Without a GPU device file it is not imported; with one, torch
    answers as before."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True, timeout=120)
    info, imported = json.loads(out.stdout.strip().splitlines()[-1])
    no_gpu = sys.platform.startswith("linux") and not any(
        os.path.exists(p) for p in _GPU_DEVICE_FILES)
    assert _no_gpu_here() is (no_gpu or sys.platform == "darwin")
    if _no_gpu_here():
        assert info == {"cuda": 0, "bf16": False} and imported is False
    else:
        assert imported is True and info["cuda"] >= 0


@pytest.mark.skipif(not _no_gpu_here(), reason="this machine may have a GPU: tests/gpu cover it")
def test_the_workers_devices_resolve_to_the_cpu_without_a_gpu(client: Client) -> None:
    devices = probe_devices(client, "auto")
    assert devices.kind == "cpu" and devices.precision is None
