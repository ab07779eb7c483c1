"""The embedded cluster's workers forked from a server that imported torch (runtime._fork).

Each program runs as a user runs one, ``python script.py``: a fork server lives as long as the
program that started it, so the pytest process is kept out of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path
from typing import Any

import dask
import pytest

import dask_train as dt
from dask_train.errors import InvalidInput
from dask_train.runtime._fork import fork_workers, function_imports

SRC = Path(__file__).resolve().parents[2] / "src"

_INFO = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import dask_train as dt
    from dask_train.data._cluster import live_workers

    def info():
        import os, sys
        return {"ppid": os.getppid(), "torch": "torch" in sys.modules, "hash": hash("dask-train"),
                "mark": os.environ.get("DT_FORK_MARK")}

    def wait_for(client, n, old=()):
        deadline = time.time() + 120
        while time.time() < deadline:
            workers = set(live_workers(client))
            if len(workers) == n and not workers & set(old):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{n} workers did not come back")
""")

# One program for both tests below (a program's start, its fork server's and its cluster's cost
# seconds each): a 2-worker embedded cluster trains, then loses a worker; a 1-worker cluster
# started after the environment changed. The loss's own log lines (a lost worker's warnings)
# are marked on stderr, where the logs go, so the clean run's check can leave them out.
_JOB = _INFO + textwrap.dedent("""
    client = dt.connect(n_workers=2, quiet=True)
    first = client.run(info)
    X, y = dt.datasets.digits(4_000, seed=0, chunks=1_000)
    result = dt.Trainer(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                            torch.nn.Linear(32, 10)),
                        ps=1, workers=2, lr=3e-3, batch_size=64, epochs=10, progress=False,
                        client=client).fit(X, y, validation=dt.datasets.digits_test())
    print("LOSS-START", file=sys.stderr, flush=True)
    lost = sorted(first)[0]
    # Only there: the task waits for that worker, never runs on the one coming back.
    killer = client.submit(os._exit, 1, workers=[lost], pure=False)
    wait_for(client, 2, old=[lost])
    killer.cancel()
    after = client.run(info)
    client.close()
    print("LOSS-END", file=sys.stderr, flush=True)
    # Set after the fork server started: a new embedded cluster must still see it.
    os.environ["DT_FORK_MARK"] = "set later"
    client = dt.connect(n_workers=1, quiet=True)
    later = client.run(info)
    client.close()
    print("RESULT", json.dumps({"main": os.getpid(), "first": list(first.values()),
                                "after": list(after.values()), "later": list(later.values()),
                                "accuracy": float(result.history["accuracy"].iloc[-1])}))
""")


def _run(tmp_path: Path, source: str) -> tuple[dict, str]:
    script = tmp_path / "job.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("DT_FORK_MARK", None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    before, _, rest = proc.stderr.partition("LOSS-START")
    _, _, after = rest.partition("LOSS-END")
    return json.loads(line[len("RESULT "):]), proc.stdout + before + after


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """The program's results, and its log without the loss's lines."""
    return _run(tmp_path_factory.mktemp("fork"), _JOB)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers are Linux-only")
@pytest.mark.timeout(300)
def test_forked_workers_start_with_torch_train_and_a_later_environment_is_seen(
        job: tuple[dict, str]) -> None:
    got, log = job
    first, later = got["first"], got["later"]
    # Both workers are children of one fork server (not of this program, whose nannies spawn),
    # and had torch the moment the cluster was up.
    assert len({w["ppid"] for w in first}) == 1 and first[0]["ppid"] != got["main"]
    assert all(w["torch"] for w in first)
    assert got["accuracy"] > 0.8  # ten epochs of 4,000 digits (0.82 after five); chance 0.1
    # The environment changed since the server started: that cluster's worker was spawned.
    assert later[0]["mark"] == "set later" and later[0]["ppid"] == got["main"]
    assert "Traceback" not in log and " ERROR " not in log and "- ERROR -" not in log, log[-4000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers are Linux-only")
@pytest.mark.timeout(300)
def test_a_worker_spawned_after_a_loss_hashes_strings_as_the_forked_ones(
        job: tuple[dict, str]) -> None:
    got, _ = job
    first, after = got["first"], got["after"]
    assert all(w["ppid"] != got["main"] for w in first)
    assert sum(w["ppid"] == got["main"] for w in after) == 1  # the nanny spawned the lost one
    # One string hash everywhere, as Dask's shuffles need: the fork server started with the
    # nanny's PYTHONHASHSEED.
    assert len({w["hash"] for w in first + after}) == 1


@pytest.mark.parametrize("config, environ", [
    ({"dask-train.fork-workers": False}, {}),
    ({"distributed.worker.multiprocessing-method": "forkserver"}, {}),
    ({}, {"OMP_NUM_THREADS": "4"}),
], ids=["switched-off", "dask-method-set", "openmp-threads"])
def test_workers_are_spawned_where_a_fork_would_not_be_what_was_asked(
        config: dict, environ: dict) -> None:
    with dask.config.set(config):
        assert fork_workers({"OMP_NUM_THREADS": "1", **environ}) == {}


# dt.run without a client starts the embedded cluster itself: its workers start with what the
# function imports (runtime._fork_imports), here modules nothing else of a worker imports.
_RUN = _INFO + textwrap.dedent("""
    import numpy as np

    def train(ctx):
        import sys
        import torch
        had = {m: m in sys.modules for m in ("sklearn.linear_model", "xml.dom.minidom",
                                             "torch._dynamo")}
        from sklearn import linear_model
        import xml.dom.minidom
        torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)  # imports torch._dynamo
        return {"had": had, "ppid": os.getppid(), "env": os.environ.get("DASK_TRAIN_FORK_IMPORTS")}

    result = dt.run(train, workers=2, data={"train": (np.zeros((8, 2), "float32"), np.zeros(8))})
    print("RESULT", json.dumps({"main": os.getpid(), "returns": result.returns,
                                "client": "sklearn.linear_model" in sys.modules}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers are Linux-only")
@pytest.mark.timeout(300)
def test_dt_run_without_a_client_starts_its_workers_with_the_functions_imports(
        tmp_path: Path) -> None:
    got, log = _run(tmp_path, _RUN)
    assert len(got["returns"]) == 2
    for rank in got["returns"]:
        assert rank["had"] == {"sklearn.linear_model": True, "xml.dom.minidom": True,
                               "torch._dynamo": True}
        assert rank["ppid"] != got["main"] and rank["env"] is None  # forked; the list not passed on
    assert got["client"] is False  # imported by the workers' server, not by the program
    assert "Traceback" not in log and " ERROR " not in log and "- ERROR -" not in log, log[-4000:]


def _helper() -> None:
    import fractions  # noqa: F401


class _Proxy:
    """A global whose every attribute raises (a lazy proxy not yet loaded)."""

    def __getattribute__(self, name: str) -> object:
        raise RuntimeError(f"{name}: not loaded")


_PROXY = _Proxy()


def _uses_everything(ctx: object) -> None:
    import torch.nn.functional as F  # noqa: F401, N812
    from sklearn import linear_model, svm  # noqa: F401

    from . import conftest  # noqa: F401 - relative: the program's own package
    json.dumps(OrderedDict())
    _helper()
    print(_PROXY)
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        pass


def test_a_functions_imports_are_found_in_its_code_its_globals_and_its_helpers() -> None:
    found = function_imports(_uses_everything)
    # `import a.b as x` names a.b alone; `from a import b` reads b from a; the module of a global
    # name; a helper of the same module, which travels with the function; none of the program's
    # own modules (relative, or this test module), nor a package that starts threads on import;
    # a global that raises whatever is asked of it is passed over.
    assert found == ["collections", "fractions", "json", "sklearn:linear_model,svm",
                     "torch.nn.functional"]
    assert function_imports(print) == [] and function_imports(len) == []


def _adam(model: object) -> object:
    import torch

    return torch.optim.Adam(model.parameters())  # type: ignore[attr-defined]


def _sgd(model: object) -> object:
    from torch.optim import SGD

    return SGD(model.parameters(), lr=0.1)  # type: ignore[attr-defined]


def _forward(model: object) -> object:
    import torch

    return model(torch.zeros(1, 2))  # type: ignore[operator]


def test_a_function_that_builds_a_torch_optimizer_has_the_server_import_dynamo() -> None:
    # Building a torch optimizer imports torch._dynamo (0.9 s of CPU a rank): the server
    # imports it first for a function that uses torch.optim, and not for one that does not.
    assert function_imports(_adam) == ["torch", "torch._dynamo"]
    assert function_imports(_sgd) == ["torch._dynamo", "torch.optim:SGD"]
    assert function_imports(_forward) == ["torch"]


def test_connect_names_bad_imports() -> None:
    with pytest.raises(InvalidInput, match="imports='torch' is invalid"):
        dt.connect(imports="torch")
    with pytest.raises(InvalidInput, match=r"imports=\['torch', 3\] is invalid"):
        dt.connect(imports=["torch", 3])


def _leave_things_for_exit(marker: str) -> dict[str, Any]:
    """In a worker: what libraries leave for the interpreter's exit (TensorFlow's AutoGraph
    registers the removal of each file it writes with ``atexit``; a ``TemporaryDirectory``
    still open is removed by a ``weakref.finalize`` at exit)."""
    import atexit
    import multiprocessing
    import os
    import sys
    import tempfile
    from pathlib import Path

    from distributed import get_worker

    def ran() -> None:
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")

    atexit.register(ran)
    kept = tempfile.TemporaryDirectory(prefix="dask-train-test-exit-")
    get_worker().dask_train_test_kept = kept  # open until the process ends
    # A process the worker forks (a DataLoader's worker does) inherits the handlers, which are
    # the worker's, not its own to run.
    child = multiprocessing.get_context("fork").Process(target=os.getpid)
    child.start()
    child.join(30)
    return {"directory": kept.name, "forked": "dask_train.runtime._fork_ready" in sys.modules,
            "pid": os.getpid(), "child": child.exitcode, "ran_in_child": Path(marker).exists()}


def test_a_forked_worker_runs_its_exit_handlers_as_a_spawned_one_does(tmp_path: Path) -> None:
    # A process forked by multiprocessing ends with os._exit: a forked worker skipped what its
    # libraries clean up at exit, and every worker that ran a Keras job left TensorFlow's
    # AutoGraph files in /tmp for good (a spawned worker, Dask's default, removes them).
    from distributed import Client, LocalCluster

    marker = tmp_path / "exit-handler-ran"
    # Not daemonic, so that the worker may start a process (as for a DataLoader's workers).
    with dask.config.set({"distributed.worker.daemon": False}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                         dashboard_address=":0") as cluster, Client(cluster) as client:
        left = client.submit(_leave_things_for_exit, str(marker), pure=False).result()
        assert left["forked"]  # the session's fork server started it (tests/conftest.py)
        assert left["child"] == 0 and not left["ran_in_child"]
        assert Path(left["directory"]).is_dir() and not marker.exists()
    assert marker.read_text() == f"{left['pid']}\n"  # once, in the worker
    assert not Path(left["directory"]).exists()
