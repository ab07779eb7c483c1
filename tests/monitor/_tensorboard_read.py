"""Read TensorBoard event files back with TensorBoard's own reader (``EventAccumulator``).

In a fresh interpreter: with TensorFlow installed, TensorBoard's file layer imports all of it
(seconds, minutes on a loaded machine) unless ``tensorboard.compat.notf`` exists -- TensorBoard's
own switch to its TF-free stub, which is a process-wide choice a shared test process must not
make for the tests that come after.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

_READ = textwrap.dedent("""
    import json, sys, types
    sys.modules["tensorboard.compat.notf"] = types.ModuleType("tensorboard.compat.notf")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
    acc.Reload()
    out = {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    print(json.dumps({"scalars": out, "tensorflow": "tensorflow" in sys.modules}))
""")


def read_scalars(directory: str | Path, timeout: float = 120) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under ``directory``: tag -> [(step, value), ...] in file order."""
    proc = subprocess.run([sys.executable, "-c", _READ, str(directory)], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["tensorflow"], "reading the event files imported TensorFlow"
    return {tag: [(int(s), float(v)) for s, v in rows] for tag, rows in result["scalars"].items()}
