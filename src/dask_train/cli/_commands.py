"""``dask-train train|search|predict CONFIG.yaml``: one job from a checked config, into a run directory."""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np

from dask_train.cli._config import Config, DataSpec, build_space
from dask_train.errors import InvalidInput

# -- data ------------------------------------------------------------------------------------------


def _read_rows(path: str, start: int, stop: int) -> np.ndarray:
    # Copy-on-write ("c"), not read-only: a block stays a view of the file and is still
    # writable, so the training blocks are not copied to be (data._inputs.writable).
    return np.ascontiguousarray(np.load(path, mmap_mode="c")[start:stop])


def npy_array(path: str, *, chunk_rows: int) -> da.Array:
    """A ``.npy`` file as a dask array: one task per block reads its own rows (memory-mapped), so
    the blocks are read on the workers, never copied into the graph (``da.from_array`` would
    put the whole array in one graph key)."""
    header = np.load(path, mmap_mode="r")
    shape, dtype = header.shape, header.dtype
    name = f"dt-npy-{dask.base.tokenize(path, Path(path).stat().st_mtime, chunk_rows)}"
    blocks = []
    for i, start in enumerate(range(0, shape[0], chunk_rows)):
        stop = min(start + chunk_rows, shape[0])
        part = dask.delayed(_read_rows, pure=True)(path, start, stop,
                                                   dask_key_name=f"{name}-read-{i}")
        blocks.append(da.from_delayed(part, shape=(stop - start, *shape[1:]), dtype=dtype))
    return da.concatenate(blocks) if blocks else da.empty(shape, dtype=dtype)


def _array(path: str, chunk_rows: int) -> da.Array:
    if path.endswith(".npy"):
        return npy_array(path, chunk_rows=chunk_rows)
    if path.rstrip("/").endswith(".zarr"):
        try:
            return da.from_zarr(path)
        except ImportError as exc:
            raise InvalidInput([f"{path} is a zarr store and zarr is not installed: pip install "
                                "zarr."]) from exc
    raise InvalidInput([f"{path}: use a .npy, .zarr, .parquet or .csv path."])


def load_data(spec: DataSpec, *, chunk_rows: int) -> tuple[Any, Any]:
    """(X, y) as dask collections; y is None when the spec has none."""
    if spec.X.rstrip("/").endswith((".parquet", ".pq", ".csv")):
        import dask.dataframe as dd

        table = dd.read_csv(spec.X) if spec.X.endswith(".csv") else dd.read_parquet(spec.X)
        columns = spec.columns or [c for c in table.columns if c != spec.y]
        missing = [c for c in [*columns, *([spec.y] if spec.y else [])] if c not in table.columns]
        if missing:
            raise InvalidInput([f"{spec.X} has no column(s) {missing}: its columns are "
                                f"{list(table.columns)}."])
        return table[columns], None if spec.y is None else table[spec.y]
    X = _array(spec.X, chunk_rows)
    return X, None if spec.y is None else _array(spec.y, chunk_rows)


def _validation(config: Config) -> tuple[np.ndarray, np.ndarray]:
    spec = config.dataset("validation")
    assert spec is not None
    Xv, yv = load_data(spec, chunk_rows=int(config.data.get("chunk_rows", 100_000)))
    return np.asarray(Xv.compute()), np.asarray(yv.compute())


def _train_data(config: Config) -> tuple[Any, Any]:
    spec = config.dataset("train")
    assert spec is not None
    return load_data(spec, chunk_rows=int(config.data.get("chunk_rows", 100_000)))


# -- runs ------------------------------------------------------------------------------------------


def run_dir(config: Config, command: str, override: Path | None) -> Path:
    """The run directory: the command's own subdirectory of ``--out`` or of the config's
    ``out`` (``out/train``, ``out/search``, ``out/predict``, ``out/run``: the commands of one
    config never overwrite each other's files, and predict reads what train wrote), else
    ``runs/<command>-<time>`` beside the config; the config is copied into it."""
    if override is not None:
        out = override / command
    elif config.out:
        out = Path(config.resolve(config.out)) / command
    else:
        out = config.path.parent / "runs" / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config.path, out / "config.yaml")
    return out


@contextlib.contextmanager
def _connect(config: Config, scheduler: str | None) -> Iterator[Any]:
    """A client for the run, current while it lasts (Dask calls that use the default client
    must use this one, also when the process holds another), closed at the end."""
    from dask_train.runtime import connect

    client = connect(scheduler or config.cluster.get("scheduler"),
                     n_workers=config.cluster.get("n_workers"), quiet=True)
    try:
        with client.as_current():
            yield client
    finally:
        client.close()


def _model_factory(config: Config) -> Any:
    return functools.partial(config.factory(), **(config.model.get("args") or {}))


def train(config: Config, *, scheduler: str | None, out: Path | None, progress: bool) -> dict[str, Any]:
    """Fit a dt.Trainer on the config's data; write the run (summary, history, plot, model)."""
    import dask_train as dt
    from dask_train.report import write_run

    # The factory itself, not a model it built: a model that cannot be pickled (weight_norm)
    # travels as its factory (see dt.Trainer's module).
    with _connect(config, scheduler) as client:
        X, y = _train_data(config)
        trainer = dt.Trainer(_model_factory(config), **config.trainer_settings(),
                             stop=config.stop_conditions(), progress=progress, client=client)
        result = trainer.fit(X, y, validation=_validation(config))
    directory = run_dir(config, "train", out)
    summary = result.summary()
    paths = write_run(directory, history=result.history, summary=summary, module=result.model)
    return {"summary": summary, "paths": {k: str(v) for k, v in paths.items()}}


def search(config: Config, *, scheduler: str | None, out: Path | None,
           progress: bool) -> dict[str, Any]:
    """dt.search over the config's space; write trials.csv, search.png, summary.json and the
    best model (model.safetensors for torch, model.pkl for an estimator)."""
    import dask_train as dt

    factory = _model_factory(config)
    settings = dict(config.search)
    space = build_space(settings.pop("space"))
    budget: dict[str, Any] = {k: settings.pop(k) for k in ("seconds", "minutes", "hours")
                              if k in settings}
    with _connect(config, scheduler) as client:
        X, y = _train_data(config)
        probe = factory()
        model = dt.Trainer(factory, **config.trainer_settings(), stop=config.stop_conditions(),
                           client=client) if _is_torch(probe) else probe
        result = dt.search(model, space, X, y, validation=_validation(config),
                           stop=config.stop_conditions(budget), progress=progress, client=client,
                           **settings)
    return write_search(result, run_dir(config, "search", out))


def _is_torch(model: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


def write_search(result: Any, directory: Path) -> dict[str, Any]:
    """A search's files in ``directory``."""
    import cloudpickle

    from dask_train.checkpoint import save_module
    from dask_train.report._run import _jsonable

    paths = {"trials": directory / "trials.csv", "plot": directory / "search.png",
             "summary": directory / "summary.json"}
    result.trials.to_csv(paths["trials"], index=False)
    result.plot(paths["plot"])
    summary = result.summary()
    paths["summary"].write_text(json.dumps(_jsonable(summary), indent=2, sort_keys=True) + "\n")
    best = result.best_model
    if _is_torch(best):
        paths["model"] = Path(save_module(best, directory / "model.safetensors"))
        history = getattr(result.best_result, "history", None)
        if history is not None:
            history.to_csv(directory / "best_history.csv", index=False)
    elif best is not None:
        paths["model"] = directory / "model.pkl"
        paths["model"].write_bytes(cloudpickle.dumps(best))
    return {"summary": summary, "paths": {k: str(v) for k, v in paths.items()}}


def predict(config: Config, *, scheduler: str | None, out: Path | None,
            progress: bool) -> dict[str, Any]:
    """dt.predict the config's model over ``data.predict``; write the predictions into the run."""
    import dask_train as dt
    from dask_train.checkpoint import load_module

    # The config's check made sure the weights are there and are this model's.
    model = load_module(_model_factory(config)(), config.resolve(str(config.model["weights"])))
    settings = config.predict
    directory = run_dir(config, "predict", out)
    target = directory / str(settings["output"])
    started = time.time()
    with _connect(config, scheduler):
        spec = config.dataset("predict")
        assert spec is not None
        X, _ = load_data(spec, chunk_rows=int(config.data.get("chunk_rows", 100_000)))
        p = dt.predict(model, X, method=settings.get("method"),
                       batch_size=int(settings.get("batch_size", 4096)))
        rows = _write_predictions(p, target)
    summary = {"rows": rows, "seconds": time.time() - started, "output": str(target)}
    (directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return {"summary": summary, "paths": {"predictions": str(target)}}


def _write_predictions(p: Any, target: Path) -> int:
    if target.suffix == ".npy":
        values = np.asarray(p.compute())
        np.save(target, values)
        return int(len(values))
    import dask.dataframe as dd

    frame = p.to_frame() if isinstance(p, dd.Series) else p
    if isinstance(p, da.Array):
        frame = dd.from_dask_array(p.reshape(p.shape[0], -1) if p.ndim > 1 else p,
                                   columns=None if p.ndim > 1 else "prediction")
        frame = frame.to_frame() if isinstance(frame, dd.Series) else frame
    frame.columns = [str(c) for c in frame.columns]
    frame.to_parquet(str(target))
    return int(len(frame))
