"""The YAML config of ``dask-train train|search|predict``: read, checked in full before any work.

Every problem (an unknown key, a missing file, a factory that does not import, a value of the
wrong type) is collected with the key it is under and raised at once as :class:`InvalidInput`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dask_train.errors import InvalidInput

EXAMPLE = """\
# dask-train train|search|predict CONFIG.yaml -- one file; each command reads its sections.
model:
  factory: mymodels:make_net        # module:function returning a torch.nn.Module (or an estimator)
  args: {hidden: 100}               # keyword arguments of the factory
  weights: runs/digits/train/model.safetensors  # predict: what `dask-train train` wrote
data:
  train: {X: data/X.npy, y: data/y.npy}       # .npy/.zarr arrays, or a .parquet/.csv table:
  validation: {X: data/Xv.npy, y: data/yv.npy} #   {X: t.parquet, columns: [a, b], y: label}
  predict: {X: data/X.npy}
  chunk_rows: 100000                # rows per block read from a .npy file
trainer:                            # any dt.Trainer argument
  loss: cross_entropy
  optimizer: adam
  lr: 0.001
  strategy: auto                    # default: the fastest of async-ps, sync, one process
  ps: 1
  workers: 2
  batch_size: 128
  epochs: 3
  # resources: {GPU: 1}             # trainers only on workers started with --resources GPU=1
stop: {accuracy: 0.97, seconds: 600}  # dt.StopAtScore per score; seconds/minutes: dt.StopAfter
search:
  space:
    lr: {loguniform: [1.0e-4, 1.0e-1]}
    batch_size: [64, 128, 256]
    hidden: {intuniform: [32, 256]}  # a factory argument
  n_trials: 16
  max_concurrent: 2
  metric: accuracy
  pruner: asha
  seconds: 600                      # the whole search's time budget
predict:
  output: predictions.npy           # .npy (gathered here) or .parquet (written by the workers)
  method: argmax                    # torch: forward, argmax, softmax; estimators: predict, ...
  batch_size: 4096
cluster: {scheduler: null, n_workers: 2}  # null: an embedded LocalCluster
out: runs/digits                    # each command writes into its own out/train, out/search, out/predict
"""

#: The strategy of a config that names none: measured on the cluster at fit time.
DEFAULT_STRATEGY = "auto"
SECTIONS = ("model", "data", "trainer", "stop", "search", "predict", "cluster", "out")
_TIME = ("seconds", "minutes", "hours")
_SPACE_KINDS = ("loguniform", "uniform", "intuniform")


@dataclass
class DataSpec:
    """One data set: an array file for X (and y), or a table with feature columns and a label."""

    X: str
    y: str | None = None
    columns: list[str] | None = None


@dataclass
class Config:
    """A checked config; ``path`` is the file it came from (relative paths are taken from its
    directory)."""

    path: Path
    model: dict[str, Any]
    data: dict[str, Any]
    trainer: dict[str, Any] = field(default_factory=dict)
    stop: dict[str, Any] = field(default_factory=dict)
    search: dict[str, Any] = field(default_factory=dict)
    predict: dict[str, Any] = field(default_factory=dict)
    cluster: dict[str, Any] = field(default_factory=dict)
    out: str | None = None

    def trainer_settings(self) -> dict[str, Any]:
        """The ``trainer`` section as ``dt.Trainer`` arguments; the strategy is ``"auto"``
        unless the config names one (the command line's default: a job measured on the cluster
        runs as one process when distributing it would be slower). YAML has no tuples:
        ``workers: [2, 8]`` is ``workers=(2, 8)``, as in the ``run`` section."""
        settings = {"strategy": DEFAULT_STRATEGY, **self.trainer}
        if isinstance(settings.get("workers"), list):
            settings["workers"] = tuple(settings["workers"])
        return settings

    def resolve(self, path: str) -> str:
        """A path of the config, from the config's directory (URLs and absolute paths as they are)."""
        if "://" in path or Path(path).is_absolute():
            return path
        return str((self.path.parent / path).resolve())

    def dataset(self, name: str) -> DataSpec | None:
        raw = self.data.get(name)
        if raw is None:
            return None
        return DataSpec(X=self.resolve(raw["X"]),
                        y=None if raw.get("y") is None else (
                            raw["y"] if raw.get("columns") is not None or _is_table(raw["X"])
                            else self.resolve(raw["y"])),
                        columns=raw.get("columns"))

    def factory(self) -> Any:
        """The model factory (``module:function``), its module importable from the config's
        directory and sent to the workers by value (they may not have the file)."""
        import cloudpickle

        module_name, _, name = self.model["factory"].partition(":")
        if str(self.path.parent) not in sys.path:
            sys.path.insert(0, str(self.path.parent))
        module = importlib.import_module(module_name)
        if not getattr(module, "__file__", "").startswith(sys.prefix):
            cloudpickle.register_pickle_by_value(module)
        return getattr(module, name)

    def stop_conditions(self, settings: Mapping[str, Any] | None = None) -> list[Any]:
        """The ``stop`` section (or ``settings``) as dt stop conditions."""
        from dask_train.policy.stop import StopAfter, StopAtScore, StopAtStep

        out: list[Any] = []
        for key, value in (self.stop if settings is None else settings).items():
            if key in _TIME:
                out.append(StopAfter(**{key: value}))
            elif key == "steps":
                out.append(StopAtStep(int(value)))
            else:
                out.append(StopAtScore(key, value))
        return out


def _is_table(path: str) -> bool:
    return path.rstrip("/").endswith((".parquet", ".csv", ".pq"))


def load_config(path: str | Path, *, command: str) -> Config:
    """Read and check ``path`` for ``command`` (``"train"``, ``"search"`` or ``"predict"``)."""
    file = Path(path)
    sections, out = read_sections(file, SECTIONS, command="train")
    config = Config(path=file.resolve(), out=out, **sections)
    problems = _model_problems(config, command) + _data_problems(config, command)
    problems += _section_problems(config, command)
    if problems:
        raise InvalidInput(problems)
    return config


def read_sections(path: Path | None, names: Sequence[str], *,
                  command: str) -> tuple[dict[str, dict[str, Any]], Any]:
    """The sections ``names`` of the YAML config at ``path`` (every one empty without a
    path), each a mapping but ``out``, and the value of ``out``; every problem raised at once
    (``command`` names the ``dask-train`` command whose ``--help`` shows an example)."""
    import yaml

    raw: Any = {}
    if path is not None:
        if not path.is_file():
            raise InvalidInput([f"config {str(path)!r} does not exist: pass the path of a YAML "
                                f"file (dask-train {command} --help shows an example)."])
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise InvalidInput([f"config {str(path)!r} is not valid YAML: {exc}"]) from exc
        if not isinstance(raw, dict):
            raise InvalidInput([f"config {str(path)!r} must be a mapping of sections "
                                f"({', '.join(names)})."])
    problems = [f"{key}: unknown section; use {', '.join(names)}." for key in raw
                if key not in names]
    sections = {k: raw.get(k) or {} for k in names if k != "out"}
    problems += [f"{k}: must be a mapping, got {type(v).__name__}." for k, v in sections.items()
                 if not isinstance(v, dict)]
    if problems:
        raise InvalidInput(problems)
    return sections, raw.get("out")


def _model_problems(config: Config, command: str) -> list[str]:
    model = config.model
    problems = [f"model.{k}: unknown key; use factory, args, weights." for k in model
                if k not in ("factory", "args", "weights")]
    factory = model.get("factory")
    if not isinstance(factory, str) or ":" not in factory:
        return problems + [f"model.factory={factory!r} is invalid: name a function as "
                           "'module:function' (e.g. mymodels:make_net)."]
    try:
        if not callable(config.factory()):
            problems.append(f"model.factory={factory!r} is not a function.")
    except (ImportError, AttributeError) as exc:
        problems.append(f"model.factory={factory!r} does not import ({type(exc).__name__}: {exc}); "
                        "put the module next to the config or on PYTHONPATH.")
    if not isinstance(model.get("args", {}), dict):
        problems.append("model.args must be a mapping of the factory's keyword arguments.")
    if command == "predict" and not problems:
        problems += _weights_problems(config)
    return problems


def _weights_problems(config: Config) -> list[str]:
    """Predict's weights: given, there, and those of the factory's model (every key, every
    shape). Without them predict would run the factory's untrained model and say nothing."""
    weights = config.model.get("weights")
    written = f"{config.out.rstrip('/')}/train/model.safetensors" if config.out else \
        "runs/NAME/train/model.safetensors"
    fix = f"set model.weights to the model.safetensors `dask-train train` wrote ({written})"
    if weights is None or weights == "":
        return [f"model.weights is missing: predict needs trained weights; {fix}."]
    path = config.resolve(str(weights))
    if not _exists(path):
        return [f"model.weights={weights!r} does not exist ({path}): run `dask-train train` "
                f"first, or {fix}."]
    try:
        model = config.factory()(**(config.model.get("args") or {}))
    except Exception as exc:  # the user's factory failing
        return [f"model.factory={config.model['factory']!r} failed to build the model "
                f"({type(exc).__name__}: {exc})."]
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(model, torch.nn.Module):
        return [f"model.weights={weights!r}: dask-train predict loads a torch module's weights "
                f"(.safetensors); model.factory builds a {type(model).__name__}: use "
                "dt.predict(model, X) in Python with the fitted estimator."]
    from dask_train.checkpoint import load_shapes

    try:
        saved = load_shapes(path)
    except InvalidInput as exc:
        return [f"model.weights={weights!r}: {p}" for p in exc.problems]
    expected = {k: list(v.shape) for k, v in model.state_dict().items()}
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    shapes = [f"{k} is {saved[k]} in the file, {v} in the model" for k, v in expected.items()
              if k in saved and saved[k] != v]
    if not (missing or extra or shapes):
        return []
    said = "; ".join([*([f"missing {missing}"] if missing else []),
                      *([f"not in the model {extra}"] if extra else []), *shapes])
    return [f"model.weights={weights!r} does not match model.factory="
            f"{config.model['factory']!r} with args {config.model.get('args') or {}} ({said}): "
            f"pass the weights a `dask-train train` run of this model section wrote, or set "
            "model.args to the ones it was trained with."]


def _exists(path: str) -> bool:
    return "://" in path or Path(path).exists()


def _data_problems(config: Config, command: str) -> list[str]:
    needed = {"train": ("train", "validation"), "search": ("train", "validation"),
              "predict": ("predict",)}[command]
    problems = [f"data.{k}: unknown key; use train, validation, predict, chunk_rows."
                for k in config.data if k not in ("train", "validation", "predict", "chunk_rows")]
    for name in needed:
        raw = config.data.get(name)
        if not isinstance(raw, dict) or "X" not in raw:
            problems.append(f"data.{name} is missing: give {{X: path, y: path}} (or a table with "
                            "columns and a label column).")
            continue
        problems += [f"data.{name}.{k}: unknown key; use X, y, columns." for k in raw
                     if k not in ("X", "y", "columns")]
        spec = config.dataset(name)
        assert spec is not None
        if not _exists(spec.X):
            problems.append(f"data.{name}.X={raw['X']!r} does not exist ({spec.X}).")
        if name != "predict" and spec.y is None:
            problems.append(f"data.{name}.y is missing: a labels file, or the label column.")
        elif spec.y is not None and "/" in spec.y and not _exists(spec.y):
            problems.append(f"data.{name}.y={raw['y']!r} does not exist ({spec.y}).")
    rows = config.data.get("chunk_rows", 100_000)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        problems.append(f"data.chunk_rows={rows!r} is invalid: use an integer >= 1.")
    return problems


def _section_problems(config: Config, command: str) -> list[str]:
    problems: list[str] = []
    if command in ("train", "search"):
        import inspect

        from dask_train.api import Trainer

        known = set(inspect.signature(Trainer).parameters) - {"module", "stop", "client"}
        problems += [f"trainer.{k}: not a dt.Trainer argument; use one of {sorted(known)}."
                     for k in config.trainer if k not in known]
        problems += _stop_problems("stop", config.stop)
    if command == "search":
        s = config.search
        allowed = ("space", "n_trials", "max_concurrent", "workers_per_trial", "metric", "mode",
                   "pruner", "seed", "timeout", *_TIME)
        problems += [f"search.{k}: unknown key; use {', '.join(allowed)}." for k in s
                     if k not in allowed]
        space = s.get("space")
        if not isinstance(space, dict) or not space:
            problems.append("search.space is missing: map parameter names to choices or ranges, "
                            "e.g. lr: {loguniform: [1.0e-4, 1.0e-1]}.")
        else:
            for name, value in space.items():
                problems += _space_problems(name, value)
    if command == "predict":
        output = config.predict.get("output")
        if not isinstance(output, str) or not output.endswith((".npy", ".parquet")):
            problems.append(f"predict.output={output!r} is invalid: a .npy or .parquet path.")
        problems += [f"predict.{k}: unknown key; use output, method, batch_size." for k in
                     config.predict if k not in ("output", "method", "batch_size")]
    cluster = config.cluster
    problems += [f"cluster.{k}: unknown key; use scheduler, n_workers." for k in cluster
                 if k not in ("scheduler", "n_workers")]
    return problems


def _stop_problems(where: str, stop: Mapping[str, Any]) -> list[str]:
    return [f"{where}.{key}={value!r} is invalid: use a number." for key, value in stop.items()
            if isinstance(value, bool) or not isinstance(value, (int, float))]


def _space_problems(name: str, value: Any) -> list[str]:
    if isinstance(value, list):
        return [] if value else [f"search.space.{name}: list at least one choice."]
    if isinstance(value, dict):
        if len(value) != 1 or next(iter(value)) not in _SPACE_KINDS:
            return [f"search.space.{name}={value!r} is invalid: use one of "
                    f"{{{', '.join(k + ': [low, high]' for k in _SPACE_KINDS)}}} or a list."]
        bounds = next(iter(value.values()))
        if not isinstance(bounds, list) or len(bounds) != 2:
            return [f"search.space.{name}={value!r} is invalid: give [low, high]."]
    return []


def build_space(space: Mapping[str, Any]) -> dict[str, Any]:
    """The config's space as ``dt.search``'s: ``{loguniform: [a, b]}`` -> ``dt.loguniform(a, b)``."""
    from dask_train import tuning

    out: dict[str, Any] = {}
    for name, value in space.items():
        if isinstance(value, dict):
            kind, (low, high) = next(iter(value.items()))
            out[name] = getattr(tuning, kind)(low, high)
        else:
            out[name] = value
    return out
