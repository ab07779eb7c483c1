"""A job's role that raises one of dask-train's own errors is reported once, by the job: a
script run as ``python script.py`` shows dask-train's message, not distributed's "Compute
Failed" records with their tracebacks; the filter lasts the job's time only, and another error
of a role keeps its record."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

_SCRIPT = textwrap.dedent("""
    import logging, sys
    import numpy as np
    import dask_train as dt

    def bad_name(ctx):
        xv, yv = ctx.dataset("va" + "lid")  # a name computed: no check before the job sees it

    def divide(ctx):
        return 1 / 0

    def worker_filters():
        import logging
        return [type(f).__name__ for f in logging.getLogger("distributed.worker").filters]

    if __name__ == "__main__":
        logging.basicConfig(level=logging.WARNING)  # the user's own logging
        X = np.random.default_rng(0).random((400, 4), dtype=np.float32)
        y = (X[:, 0] > 0.5).astype(np.int64)
        data = {"train": (X, y), "val": (X[:50], y[:50])}
        client = dt.connect(n_workers=2)
        before = client.run(worker_filters)
        try:
            dt.run(bad_name, data=data, epochs=1, client=client)
        except dt.RoleFailed as exc:
            print("caught", type(exc.__cause__).__name__, exc, flush=True)
        print("filters as before", client.run(worker_filters) == before, flush=True)
        sys.stderr.write("--- the second job ---\\n")
        sys.stderr.flush()
        try:
            dt.run(divide, data=data, epochs=1, client=client)
        except dt.RoleFailed as exc:
            print("caught", type(exc.__cause__).__name__, flush=True)
        client.close()
""")


def test_a_ranks_own_error_reaches_a_script_without_dasks_tracebacks(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, "script.py"], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path, env={"PYTHONPATH": str(SRC),
                                                          "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    first, _, second = proc.stderr.partition("--- the second job ---")
    assert second, proc.stderr[-4000:]
    # The error reached the caller, with its message, and nothing else said it.
    assert "caught InvalidInput rank " in proc.stdout and \
        "failed: InvalidInput: ctx.dataset('valid'): the job's data sets are ['val']" \
        in proc.stdout, proc.stdout
    assert "Compute Failed" not in first and "ERROR" not in first \
        and "Traceback" not in first, first[-4000:]
    # Removed with its job: the workers' log filters are as they were, and a role's error that
    # is not dask-train's own keeps distributed's record.
    assert "filters as before True" in proc.stdout, proc.stdout
    assert "caught ZeroDivisionError" in proc.stdout, proc.stdout
    assert "Compute Failed" in second and "ZeroDivisionError" in second, second[-4000:]
