"""Start-up costs a user waits for, each in a fresh process: imports, the embedded cluster, the
first training step, closing.

Usage::

    python benchmarks/startup.py [--repeats 5]

Rows (medians and ranges over ``--repeats`` fresh processes, one after the other):

* ``import torch`` alone, and ``import torch`` then ``import dask_train`` and its first use of
  ``dt.Trainer`` (what a training script pays beyond torch);
* ``import dask_train`` alone, and with ``dt.LogisticRegression`` (scikit-learn, no torch);
* ``distributed.Client(n_workers=2, ...)`` (a plain LocalCluster) against ``dt.connect(n_workers=2)``,
  imports included in both, and closing each;
* a fit's ``roles`` + ``first_step`` phases (``FitResult.timings``) for async-ps and sync, on a
  cluster that has already run one fit (the second fit of the process) and on a fresh one.

Written to ``results/startup.md``; nothing is asserted. Aims (issue "Time to accuracy"):
``import dask_train`` under 1 s beyond ``import torch``; ``dt.connect`` within 1.5x of a plain
LocalCluster; role start-up to the first step under 1 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, markdown_table, write_results  # noqa: E402

PROGRAMS = {
    "import torch": "import torch",
    "import torch, dask_train; dt.Trainer": "import torch\nimport dask_train as dt\ndt.Trainer",
    "import dask_train": "import dask_train",
    "import dask_train; dt.LogisticRegression (scikit-learn, no torch)": """
        import sys
        import dask_train as dt
        dt.LogisticRegression
        assert "torch" not in sys.modules
        """,
}

CLUSTER = """
    import json, time, sys
    t0 = time.perf_counter()
    if sys.argv[1] == "plain":
        from distributed import Client
        client = Client(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")
    else:
        import dask_train as dt
        client = dt.connect(n_workers=2, quiet=True)
    client.submit(sum, [1, 2]).result()
    start = time.perf_counter() - t0
    t0 = time.perf_counter()
    client.close()
    print("RESULT " + json.dumps({"start": start, "close": time.perf_counter() - t0}))
    """

FIT = """
    import json, sys
    import torch
    import dask_train as dt
    if __name__ == "__main__":
        client = dt.connect(n_workers=2, quiet=True)
        X, y = client.persist(dt.datasets.digits(50_000, seed=0))
        v = dt.datasets.digits_test()
        out = {}
        for i in range(2):
            net = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))
            r = dt.Trainer(net, strategy=sys.argv[1], batch_size=64, score_every=0.5,
                           stop=[dt.StopAtStep(20)], progress=False, client=client).fit(X, y, validation=v)
            out["first" if i == 0 else "warm"] = r.timings
        client.close()
        print("RESULT " + json.dumps(out))
    """


def _time(code: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(line[-1][7:])


def _import_time(code: str) -> float:
    timed = ("import time\nt0 = time.perf_counter()\n" + textwrap.dedent(code) +
             "\nimport json\nprint('RESULT ' + json.dumps({'s': time.perf_counter() - t0}))")
    return float(_time(timed)["s"])


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows, raw = [], {}
    for name, code in PROGRAMS.items():
        values = [_import_time(code) for _ in range(args.repeats)]
        raw[name] = values
        rows.append({"what": name, "seconds": _cell(values)})
        print(rows[-1], flush=True)
    for mode, label in (("plain", "distributed.Client(n_workers=2)"), ("dt", "dt.connect(n_workers=2)")):
        runs = [_time(CLUSTER, mode) for _ in range(args.repeats)]
        raw[label] = runs
        rows.append({"what": f"{label}: start (imports included)",
                     "seconds": _cell([r["start"] for r in runs])})
        rows.append({"what": f"{label}: close", "seconds": _cell([r["close"] for r in runs])})
        print(rows[-2:], flush=True)
    for strategy in ("async-ps", "sync"):
        runs = [_time(FIT, strategy) for _ in range(max(1, args.repeats // 2))]
        raw[f"fit {strategy}"] = runs
        for which in ("first", "warm"):
            values = [r[which]["roles"] + r[which]["first_step"] for r in runs]
            rows.append({"what": f"{strategy}: roles + first step, {which} fit of the process",
                         "seconds": _cell(values)})
        print(rows[-2:], flush=True)
    table = markdown_table(rows, ["what", "seconds"])
    print(table)
    write_results("startup", table, {"environment": environment(), "raw": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
