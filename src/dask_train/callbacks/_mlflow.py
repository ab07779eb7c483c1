"""MLflow tracking written by the controller, in the client process (one writer per job).

The hooks use ``mlflow.MlflowClient`` with the run's id, not MLflow's fluent functions: the score
hooks run on the callbacks' own thread (see :class:`~dask_train.policy.callbacks.Callback`), and
MLflow keeps its active run per thread. The run itself is found as an MLflow user expects: the
run active where ``fit`` (or ``dt.run``) was called, if any, in the tracking store MLflow is
configured for (``MLFLOW_TRACKING_URI``, ``mlflow.set_tracking_uri``), unless ``tracking_uri=``
says otherwise.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from dask_train.errors import InvalidInput
from dask_train.policy.callbacks import Callback

logger = logging.getLogger(__name__)

# History columns logged under their own names besides the scores; the rest are not metrics.
_NOT_METRICS = {"time_s", "step", "samples"}
_MAX_PARAM = 1000  # characters of a parameter's text (MLflow's limit is 6000 since 2.x)
_MAX_TAG = 5000  # characters of the error tag (MLflow keeps up to 8000 of a tag's value)


class MLflow(Callback):
    """Log a job to MLflow: its parameters, every score, and the final model or checkpoint.

    * ``on_fit_start``: the job's parameters (a Trainer's ``get_params()``; ``dt.run``'s
      ``config`` and, under ``run.``, its settings), nested ones as ``name.key``.
    * ``on_score``: every number of each score record (the validation scores, the reported
      metrics of ``dt.run``, ``epoch``, ``samples_per_s``) at the record's step.
    * ``on_fit_end``: with ``log_model``, the trained torch model as ``model/model.safetensors``
      (a Trainer job), or the newest checkpoint directory under ``checkpoint/`` (``dt.run``, or
      a model that is not torch); then the run is ended (FINISHED) if this callback started it.
    * ``on_fit_error`` (the job raised: a role's error, workers lost beyond ``max_failures``,
      Ctrl-C): the error as the tag ``dask_train.error``, the newest checkpoint the job wrote
      (with ``log_model``), then a run this callback started ends as FAILED, or KILLED on
      ``KeyboardInterrupt``. Every score before the error is logged already.

    Which run: the run active in the thread that called ``fit``/``dt.run``
    (``with mlflow.start_run(): ...``), which is left running, for its owner to end (its
    ``with`` block marks it FAILED when the error leaves it); otherwise a new run in
    ``experiment`` (MLflow's current experiment when None: ``MLFLOW_EXPERIMENT_NAME``,
    ``mlflow.set_experiment``), ended when the job ends.
    Only the client process writes, so the workers need no access to the tracking store.

    Parameters
    ----------
    experiment : str, optional
        Experiment name, created when missing.
    run_name : str, optional
        Name of a new run.
    tracking_uri : str, optional
        Tracking store; MLflow's own setting (``MLFLOW_TRACKING_URI``) when None. A store other
        than the active run's gets a new run.
    log_model : bool
        Log the final model or the newest checkpoint as an artifact.

    Attributes
    ----------
    run_id : str or None
        The MLflow run of the latest job.

    Examples
    --------
    >>> cb = dt.callbacks.MLflow(experiment="digits", run_name="adam-3e-3")  # doctest: +SKIP
    >>> dt.Trainer(net, callbacks=[cb]).fit(X, y, validation=(Xv, yv))      # doctest: +SKIP
    >>> mlflow.MlflowClient().get_run(cb.run_id).data.metrics                # doctest: +SKIP
    """

    def __init__(self, experiment: str | None = None, run_name: str | None = None,
                 tracking_uri: str | None = None, log_model: bool = True) -> None:
        problems = [f"{name}={value!r} is invalid: pass a non-empty string or None."
                    for name, value in (("experiment", experiment), ("run_name", run_name),
                                        ("tracking_uri", tracking_uri))
                    if value is not None and (not isinstance(value, str) or not value)]
        if not isinstance(log_model, bool):
            problems.append(f"log_model={log_model!r} is invalid: pass True or False.")
        if problems:
            raise InvalidInput(problems)
        if importlib.util.find_spec("mlflow") is None:
            raise ImportError("dt.callbacks.MLflow needs the mlflow package: "
                              "pip install 'dask-train[mlflow]' (or pip install mlflow)")
        self.experiment, self.run_name = experiment, run_name
        self.tracking_uri, self.log_model = tracking_uri, log_model
        self.run_id: str | None = None
        self._client: Any = None
        self._owned = False

    # -- the run -----------------------------------------------------------------------------------
    def on_fit_start(self, info: Mapping[str, Any]) -> None:
        """Find or start the run; log the job's parameters."""
        import mlflow

        uri = self.tracking_uri or mlflow.get_tracking_uri()
        self._client = mlflow.MlflowClient(tracking_uri=uri)
        active = mlflow.active_run()
        if active is not None and (self.tracking_uri is None or
                                   self.tracking_uri == mlflow.get_tracking_uri()):
            self.run_id, self._owned = active.info.run_id, False
        else:
            run = self._client.create_run(self._experiment_id(mlflow), run_name=self.run_name,
                                          tags={"dask_train.job": "true"})
            self.run_id, self._owned = run.info.run_id, True
        self._log_params(flat_params(info.get("params") or {}))

    def _experiment_id(self, mlflow: Any) -> str:
        if self.experiment is not None:
            found = self._client.get_experiment_by_name(self.experiment)
            return str(found.experiment_id) if found is not None else \
                str(self._client.create_experiment(self.experiment))
        if self.tracking_uri is None or self.tracking_uri == mlflow.get_tracking_uri():
            # MLflow's current experiment (set_experiment, MLFLOW_EXPERIMENT_NAME/_ID): its
            # fluent API has no public getter for it.
            from mlflow.tracking.fluent import _get_experiment_id

            return str(_get_experiment_id())
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        found = self._client.get_experiment_by_name(name) if name else None
        return str(found.experiment_id) if found is not None else \
            os.environ.get("MLFLOW_EXPERIMENT_ID", "0")

    def _log_params(self, params: Mapping[str, str]) -> None:
        """Log the parameters the run does not hold yet (MLflow refuses to change one: a second
        job in the same active run with another value is logged, not raised)."""
        from mlflow.entities import Param

        held = self._client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in params.items() if k in held and held[k] != v)
        if changed:
            logger.warning("MLflow run %s already holds other values of %s: kept as they were",
                           self.run_id, ", ".join(changed))
        new = [Param(k, v) for k, v in params.items() if k not in held]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 parameters a batch
            self._client.log_batch(self.run_id, params=new[i:i + 100])

    # -- scores --------------------------------------------------------------------------------------
    def on_score(self, record: Mapping[str, Any]) -> bool | None:
        """Log the record's numbers at its step."""
        from mlflow.entities import Metric

        if self._client is None:  # used without on_fit_start (called by hand)
            self.on_fit_start({})
        now, step = int(time.time() * 1000), int(record.get("step", 0))
        metrics = [Metric(_key(name), float(value), now, step) for name, value in record.items()
                   if name not in _NOT_METRICS and _is_number(value)]
        if metrics:
            self._client.log_batch(self.run_id, metrics=metrics)
        return None

    # -- the end -------------------------------------------------------------------------------------
    def on_fit_end(self, result: Any) -> None:
        """Log the final model or the newest checkpoint; end the run if this callback began it."""
        if self._client is None:
            return
        if self.log_model:
            self._log_result(result)
        if self._owned:
            self._client.set_terminated(self.run_id, "FINISHED")

    def on_fit_error(self, error: BaseException, partial: Mapping[str, Any]) -> None:
        """Log the error and the newest checkpoint; end a run this callback began as FAILED
        (KILLED on Ctrl-C)."""
        if self._client is None:
            return
        self._client.set_tag(self.run_id, "dask_train.error",
                             f"{type(error).__name__}: {error}"[:_MAX_TAG])
        checkpoints = partial.get("checkpoints") or []
        if self.log_model and checkpoints:
            try:
                self._log_directory(str(checkpoints[-1]["directory"]), "checkpoint")
            except Exception:  # pruned or unreachable: the run still ends with its status
                logger.warning("MLflow run %s: the newest checkpoint %s could not be logged",
                               self.run_id, checkpoints[-1]["directory"], exc_info=True)
        if self._owned:
            self._client.set_terminated(
                self.run_id, "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")

    def _log_result(self, result: Any) -> None:
        torch = sys.modules.get("torch")
        model = getattr(result, "model", None)
        if torch is not None and isinstance(model, torch.nn.Module):
            from dask_train.checkpoint import save_module

            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "model.safetensors")
                save_module(model, path)
                self._client.log_artifact(self.run_id, path, "model")
            return
        checkpoints = getattr(result, "checkpoints", None) or []
        if checkpoints:
            self._log_directory(str(checkpoints[-1]["directory"]), "checkpoint")

    def _log_directory(self, directory: str, artifact_path: str) -> None:
        """A checkpoint directory, local or at any fsspec URL, as artifacts."""
        import fsspec

        fs, path = fsspec.core.url_to_fs(directory)
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if "file" in fs.protocol:
            self._client.log_artifacts(self.run_id, path, f"{artifact_path}/{name}")
            return
        with tempfile.TemporaryDirectory() as tmp:
            fs.get(path.rstrip("/") + "/", tmp + "/", recursive=True)
            self._client.log_artifacts(self.run_id, tmp, f"{artifact_path}/{name}")


def flat_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The job's parameters as MLflow's text values; nested mappings as ``name.key``.

    Examples
    --------
    >>> flat_params({"lr": 0.01, "optimizer_options": {"momentum": 0.9}, "hidden": (64, 32)})
    {'lr': '0.01', 'optimizer_options.momentum': '0.9', 'hidden': '(64, 32)'}
    """
    out: dict[str, str] = {}
    for name, value in params.items():
        key = _key(f"{prefix}{name}")
        if isinstance(value, Mapping):
            out.update(flat_params(value, prefix=f"{key}."))
        else:
            out[key] = _param_text(value)[:_MAX_PARAM]
    return out


def _param_text(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return str(value)
    if isinstance(value, (list, tuple)):
        parts = [_param_text(v) for v in value]
        return f"[{', '.join(parts)}]" if isinstance(value, list) else f"({', '.join(parts)})"
    describe = getattr(value, "describe", None)  # a stop condition
    if callable(describe):
        return str(describe())
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}".lstrip(".")
    return type(value).__name__  # a module, an optimizer object: its class (its repr may be huge)


def _key(name: str) -> str:
    """A metric or parameter name MLflow accepts (letters, digits, ``_-. /``)."""
    return re.sub(r"[^\w\-. /]", "_", str(name))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
