"""The package's import rules: the layers import one way, and the light paths stay light.

* An import graph read from the source (``ast``, every ``import`` of ``dask_train.*`` at module and
  at function level, relative ones included): no cycle between packages, and every edge allowed by
  :data:`ALLOWED` below.
* ``import dask_train`` and its light names load none of torch, scikit-learn, SciPy, matplotlib.
* Fitting a classical model on a real cluster loads torch neither in the client nor in a worker.

The two last run in a fresh interpreter (the packages each in a child forked from one): this
test session has long imported torch (conftest).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE_DIR = SRC / "dask_train"
ROOT = "dask_train"  # the top-level package itself (its __init__: the lazy facade)

# Who may import whom, by package (the first part under ``dask_train``; ``errors`` and ``_lazy``
# are single modules that count as packages). The order is the redesign's layering:
#
#     policy <- data <- runtime <- engines <- controller <- api <- cli
#
# each layer may use every layer below it, never one above. Beside the spine:
#   * errors, _lazy: usable by everyone, import nothing of dask_train;
#   * models (framework adapters): import only errors and policy; usable by engines and above;
#   * checkpoint (safetensors IO): imports only errors; usable by engines and above;
#   * classical: at the engines level; may import policy, data, runtime, errors and models._array
#     only (see MODULE_ONLY) -- never torch (see test_classical_never_imports_torch). It never
#     imports engines, nor engines it: the plumbing both use (the blocks, the tree reduction) is
#     in data and runtime;
#   * report (tables, plots, run folders): imports errors and checkpoint (saving a model);
#     usable by the controller (history tables) and above;
#   * datasets: imports errors, policy, data; used only by the cli (and by users);
#   * monitor (the scheduler plugin: Training page, Prometheus metrics): imports errors only;
#     the controller registers it and publishes the job's events;
#   * callbacks (public callbacks: TensorBoard, MLflow): imports errors, policy and checkpoint
#     (MLflow logs the model as safetensors); used by users;
#   * lightning (PyTorch Lightning inside dt.run): imports errors, and from engines what its
#     report callback shares with Hugging Face's (engines.run.metrics: the check of its options,
#     the numbers of a framework's log); used by users;
#   * huggingface (transformers' Trainer inside dt.run): imports errors, from engines the same
#     report parts, and from data the reading of a datasets.Dataset in blocks (from_dataset and
#     dt.run(data=) read it one way); used by users;
#   * prediction (dt.predict): at the engines level, beside it: policy, data, runtime, models;
#   * tuning (dt.search): above api, it runs Trainer fits, GLM fits and XGBoost jobs as trials;
#   * tensorflow (start_tensorflow): a user of the runtime, beside the engines; imports errors,
#     policy, runtime, and from data the one wait on futures that needs no default client;
#   * launcher (dt.launch, a torchrun script on the workers): a user of the runtime, beside the
#     engines; imports errors, policy (the workers' settings) and runtime;
#   * bench (the multi-host harness, the throughput grid): above api, below the cli; runs Trainers
#     on datasets and probes with the engines;
#   * cli and the root package (the lazy facade): the top; may import everything.
_BASE = {"errors", "_lazy"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "_lazy": set(),
    "policy": _BASE,
    "data": _BASE | {"policy"},
    "runtime": _BASE | {"policy", "data"},
    "models": _BASE | {"policy"},
    "checkpoint": _BASE,
    "classical": _BASE | {"policy", "data", "runtime", "models"},
    "engines": _BASE | {"policy", "data", "runtime", "models", "checkpoint"},
    "report": _BASE | {"checkpoint"},
    "datasets": _BASE | {"policy", "data"},
    "monitor": _BASE,
    "callbacks": _BASE | {"policy", "checkpoint"},
    "lightning": _BASE | {"engines"},
    "huggingface": _BASE | {"data", "engines"},
    "controller": _BASE | {"policy", "data", "runtime", "models", "checkpoint", "engines", "report",
                           "monitor"},
    "tensorflow": _BASE | {"policy", "data", "runtime"},
    # dt.launch: one program per worker, in a child process of a pinned task.
    "launcher": _BASE | {"policy", "runtime"},
    "api": _BASE | {"policy", "data", "runtime", "models", "checkpoint", "classical", "engines",
                    "controller", "report", "monitor"},
    # dt.predict: a model's outputs over dask collections, one task per block.
    "prediction": _BASE | {"policy", "data", "runtime", "models"},
    # dt.search: trials are jobs of the api (Trainer), the classical GLMs or XGBoost.
    "tuning": _BASE | {"policy", "data", "runtime", "models", "checkpoint", "classical", "engines",
                       "controller", "report", "api", "prediction", "monitor"},
    "bench": _BASE | {"policy", "data", "runtime", "models", "checkpoint", "engines", "controller",
                      "api", "report", "datasets"},
}
_EVERYTHING = set(ALLOWED)
ALLOWED["cli"] = _EVERYTHING | {ROOT}
ALLOWED[ROOT] = _EVERYTHING | {"cli"}

# Narrower rules inside an allowed package edge: (importer package, imported package) -> the only
# modules it may import there. classical may use the numpy adapter, not the torch one.
MODULE_ONLY: dict[tuple[str, str], set[str]] = {
    ("classical", "models"): {"dask_train.models._array"},
}


@dataclass(frozen=True)
class Edge:
    importer: str  # dotted module name of the importing file
    imported: str  # dotted module name it imports (a module when one exists, else the package)
    line: int
    function_level: bool

    @property
    def source(self) -> str:
        return package_of(self.importer)

    @property
    def target(self) -> str:
        return package_of(self.imported)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def package_of(module: str) -> str:
    """``dask_train.engines.harness.control`` -> ``engines``; ``dask_train`` -> the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def module_exists(module: str) -> bool:
    relative = Path(*module.split("."))
    return (SRC / relative).with_suffix(".py").is_file() or (SRC / relative / "__init__.py").is_file()


def source_files() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def _resolve_relative(importer: str, importer_is_package: bool, level: int, module: str | None) -> str:
    # A package's own __init__ resolves ``.`` to itself; a module resolves it to its parent.
    base = importer.split(".")
    if not importer_is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(path: Path) -> Iterator[Edge]:
    """Every import of ``dask_train.*`` in ``path``, wherever it sits (module, function, if)."""
    importer = module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    function_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function_lines.update(
                child.lineno for child in ast.walk(node) if isinstance(child, ast.Import | ast.ImportFrom)
            )
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (
                _resolve_relative(importer, is_package(path), node.level, node.module)
                if node.level
                else node.module or ""
            )
            # ``from pkg import sub`` imports the module ``pkg.sub`` when there is one.
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                targets.append(candidate if module_exists(candidate) else base)
        else:
            continue
        for target in targets:
            if target == ROOT or target.startswith(ROOT + "."):
                yield Edge(importer, target, node.lineno, node.lineno in function_lines)


def all_edges() -> list[Edge]:
    return list(_all_edges())


@functools.cache
def _all_edges() -> tuple[Edge, ...]:
    # Read once a session (about a second of parsing): the source does not change under the tests.
    return tuple(edge for path in source_files() for edge in imports_of(path))


def rule_violation(edge: Edge) -> str | None:
    source, target = edge.source, edge.target
    if source == target:
        return None
    if source not in ALLOWED:
        return f"package {source!r} has no row in ALLOWED: add one in tests/test_imports.py"
    if target not in ALLOWED[source]:
        allowed = ", ".join(sorted(ALLOWED[source])) or "nothing"
        return f"{source} may import only: {allowed}"
    only = MODULE_ONLY.get((source, target))
    if only is not None and edge.imported not in only:
        return f"{source} may import from {target} only: {', '.join(sorted(only))}"
    return None


def package_cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        if edge.source != edge.target:
            graph.setdefault(edge.source, set()).add(edge.target)
            graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _describe(edge: Edge) -> str:
    where = "function-level" if edge.function_level else "module-level"
    return f"{edge.importer} -> {edge.imported} (line {edge.line}, {where})"


# --- the graph ----------------------------------------------------------------------------------


def test_graph_reader_sees_function_level_imports() -> None:
    # The reader itself: a regression here would make the two tests below pass vacuously.
    edges = all_edges()
    assert len(edges) > 50
    assert any(edge.function_level for edge in edges)
    assert {package_of(edge.importer) for edge in edges} >= {"policy", "runtime", "classical"}


def test_relative_imports_resolve() -> None:
    assert _resolve_relative("dask_train.report._run", False, 1, "_plot") == "dask_train.report._plot"
    assert _resolve_relative("dask_train.report", True, 1, "_plot") == "dask_train.report._plot"
    assert _resolve_relative("dask_train.report._run", False, 2, "errors") == "dask_train.errors"


def test_every_package_has_a_rule() -> None:
    packages = {package_of(module_name(path)) for path in source_files()}
    assert packages <= set(ALLOWED), f"packages without a row in ALLOWED: {packages - set(ALLOWED)}"


def test_no_import_cycle_between_packages() -> None:
    edges = all_edges()
    cycles = package_cycles(edges)
    lines = []
    for cycle in cycles:
        members = set(cycle)
        lines.append(" <-> ".join(cycle))
        lines.extend(
            f"    {_describe(edge)}" for edge in edges
            if edge.source in members and edge.target in members and edge.source != edge.target
        )
    assert not cycles, "import cycles between packages:\n" + "\n".join(lines)


def test_every_import_respects_the_layers() -> None:
    violations = [
        f"{_describe(edge)}: {reason}"
        for edge in all_edges()
        if (reason := rule_violation(edge)) is not None
    ]
    assert not violations, "imports against the layer rules:\n" + "\n".join(violations)


def test_classical_never_imports_torch() -> None:
    # classical is the torch-free path: a GLM fit must not cost a 2 s torch import per worker.
    offenders = []
    for path in sorted((PACKAGE_DIR / "classical").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            offenders += [
                f"{module_name(path)} line {node.lineno}: {name}"
                for name in names
                if name == "torch" or name.startswith("torch.")
            ]
    assert not offenders, "classical imports torch:\n" + "\n".join(offenders)


# --- what loads: fresh interpreters -------------------------------------------------------------

HEAVY = ("torch", "sklearn", "scipy", "matplotlib", "tensorflow", "keras", "lightning", "mlflow",
         "datasets", "transformers")


def _run_fresh(code: str, timeout: float = 240) -> Any:
    """Run ``code`` in a new interpreter on this source tree; it prints one JSON line last."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_loads_no_heavy_library() -> None:
    result = _run_fresh(
        f"""
        import json, sys
        heavy = {HEAVY!r} + ("pandas",)
        import dask_train as dt
        after_import = [m for m in heavy if m in sys.modules]
        dt.__version__
        dt.StopAtScore
        dt.connect
        after_names = [m for m in heavy if m in sys.modules]
        print(json.dumps({{"import": after_import, "names": after_names}}))
        """
    )
    assert not set(result["import"]) & set(HEAVY), f"import dask_train loaded {result['import']}"
    assert "torch" not in result["names"], f"dt.StopAtScore / dt.connect loaded {result['names']}"
    # pandas is not forbidden, but today nothing on this path needs it.
    assert "pandas" not in result["import"]


def test_the_trainer_loads_no_dask_array_until_data_needs_it() -> None:
    """``dt.Trainer`` alone does not import dask.array (0.7 s of a script's start-up); a
    collection made by the user, or ``fit`` given in-memory data, brings it in."""
    result = _run_fresh(
        """
        import json, sys
        import dask_train as dt
        dt.Trainer
        print(json.dumps("dask.array" in sys.modules))
        """
    )
    assert result is False, "dt.Trainer imported dask.array"


# Packages whose import must stay light, and the heavy libraries each may not load at import:
# torch, matplotlib and scikit-learn load inside the functions that use them, so a client or a
# worker that imports the package for one light name never pays for them. SciPy is not listed:
# ``import dask.array`` imports scipy.sparse itself when SciPy is installed (dask's chunk types),
# so any package on dask arrays loads it; only ``import dask_train`` (above) must stay without.
NOT_AT_IMPORT = ("torch", "sklearn", "matplotlib")
LIGHT_AT_IMPORT: dict[str, tuple[str, ...]] = {
    "dask_train.policy": NOT_AT_IMPORT,
    "dask_train.data": NOT_AT_IMPORT,
    "dask_train.runtime": NOT_AT_IMPORT,
    "dask_train.models": NOT_AT_IMPORT,
    "dask_train.models._array": NOT_AT_IMPORT,
    "dask_train.checkpoint": NOT_AT_IMPORT,
    "dask_train.report": NOT_AT_IMPORT,
    "dask_train.datasets": NOT_AT_IMPORT,
    # The scheduler imports monitor to unpickle its plugin: Bokeh and prometheus_client load
    # only when the plugin starts; callbacks loads TensorBoard when a fit opens its file.
    "dask_train.monitor": (*NOT_AT_IMPORT, "bokeh", "prometheus_client", "tensorboard"),
    "dask_train.callbacks": (*NOT_AT_IMPORT, "bokeh", "tensorboard", "tensorflow", "mlflow"),
    "dask_train.prediction": NOT_AT_IMPORT,
    "dask_train.tuning": NOT_AT_IMPORT,
    "dask_train.tensorflow": NOT_AT_IMPORT + ("tensorflow", "keras"),
    "dask_train.bench": NOT_AT_IMPORT,
    "dask_train.launcher": NOT_AT_IMPORT,
    # GLMs subclass scikit-learn's estimators and solve with SciPy: only torch and matplotlib.
    "dask_train.classical": ("torch", "matplotlib"),
}


# What every package above imports first: each is imported once, in one interpreter, and every
# package's import runs in a child forked from it (about 0.7 s of CPU less per package). The
# child sees what a fresh interpreter would: a module's code runs once, whichever import comes
# first, and the interpreter shows that this base loads none of the watched libraries.
LIGHT_BASE = ("distributed", "dask.array")


@pytest.fixture(scope="module")
def light_imports() -> dict[str, Any]:
    """For each package of LIGHT_AT_IMPORT, the watched libraries its import loaded (or the
    traceback of its failed import); under "base", those the base itself loaded."""
    return _run_fresh(
        f"""
        import json, os, sys, traceback
        for name in {LIGHT_BASE!r}:
            __import__(name)
        cases = {LIGHT_AT_IMPORT!r}
        results = {{"base": sorted({{m for ms in cases.values() for m in ms if m in sys.modules}})}}
        for module, watched in cases.items():
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: import the package, say what came with it, exit at once
                os.close(read)
                try:
                    __import__(module)
                    found = {{"loaded": [m for m in watched if m in sys.modules]}}
                except BaseException:
                    found = {{"error": traceback.format_exc()}}
                with os.fdopen(write, "w") as out:
                    out.write(json.dumps(found))
                os._exit(0)
            os.close(write)
            with os.fdopen(read) as pipe:
                text = pipe.read()
            os.waitpid(pid, 0)
            results[module] = json.loads(text) if text else {{"error": "the child said nothing"}}
        print(json.dumps(results))
        """
    )


@pytest.mark.parametrize("module", sorted(LIGHT_AT_IMPORT))
def test_package_import_stays_light(module: str, light_imports: dict[str, Any]) -> None:
    assert not light_imports["base"], \
        f"{LIGHT_BASE} loaded {light_imports['base']}: the packages' check needs a base without"
    result = light_imports[module]
    assert "error" not in result, f"import {module} failed:\n{result.get('error')}"
    assert not result["loaded"], f"import {module} loaded {result['loaded']}"


@pytest.fixture(scope="module")
def jobs_on_a_cluster() -> dict[str, Any]:
    """A classical fit, then a dt.run job, in one fresh interpreter on one embedded cluster (one
    cluster's start less than a cluster each): what each loaded where, read right after it; a
    part that raised gives its traceback instead."""
    return _run_fresh(
        """
        import json, sys, traceback

        import dask.array as da
        import numpy as np

        import dask_train as dt

        def train(ctx):
            import torch

            for x, y in ctx.batches(batch_size=8):
                pass
            ctx.report({"rows": float(torch.tensor(ctx.step))})
            return ctx.rank

        found = {}
        client = dt.connect(n_workers=2, threads_per_worker=1, quiet=True)
        try:
            # First the classical fit: its workers are asked before the job's ranks import torch.
            try:
                rng = np.random.default_rng(0)
                X = rng.normal(size=(400, 5))
                y = (X @ rng.normal(size=5) > 0).astype(int)
                model = dt.LogisticRegression().fit(
                    da.from_array(X, chunks=100), da.from_array(y, chunks=100)
                )
                accuracy = float(np.mean(np.asarray(model.predict(X)) == y))
                workers = client.run(lambda: "torch" in sys.modules)
                found["classical"] = {"client": "torch" in sys.modules, "workers": workers,
                                      "accuracy": accuracy}
            except Exception:
                found["classical"] = {"error": traceback.format_exc()}
            before = "torch" in sys.modules
            try:
                x = np.arange(64, dtype="float32").reshape(32, 2)
                result = dt.run(train, workers=2, data={"train": (x, np.zeros(32))}, client=client)
                found["run"] = {"before": before, "client": "torch" in sys.modules,
                                "returns": result.returns, "history": len(result.history)}
            except Exception:
                found["run"] = {"error": traceback.format_exc()}
        finally:
            cluster = client.cluster
            client.close()
            if cluster is not None:
                cluster.close()
        print(json.dumps(found))
        """
    )


@pytest.mark.timeout(300)
def test_classical_fit_loads_no_torch_in_client_or_workers(
        jobs_on_a_cluster: dict[str, Any]) -> None:
    result = jobs_on_a_cluster["classical"]
    assert "error" not in result, f"the classical fit failed:\n{result.get('error')}"
    assert result["accuracy"] > 0.9  # the fit really ran
    assert result["client"] is False, "the classical fit imported torch in the client"
    assert len(result["workers"]) == 2
    loaded = [address for address, has in result["workers"].items() if has]
    assert not loaded, f"the classical fit imported torch in workers {loaded}"


@pytest.mark.timeout(300)
def test_dt_run_loads_no_torch_in_the_client(jobs_on_a_cluster: dict[str, Any]) -> None:
    # The ranks import torch; the client only places them and follows their reports. Importing
    # torch there put a second (more on a loaded machine) before the job's first step.
    result = jobs_on_a_cluster["run"]
    assert "error" not in result, f"dt.run failed:\n{result.get('error')}"
    assert result["before"] is False, \
        "torch was in the client before dt.run (see test_classical_fit_loads_no_torch_...)"
    assert result["returns"] == [0, 1] and result["history"] == 1  # the job really ran
    assert result["client"] is False, "dt.run imported torch in the client"
