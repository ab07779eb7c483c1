"""Keras 3 models (TensorFlow backend) behind the engines' model interface.

The engines talk to a model only through an adapter (see :mod:`._flat`); this is the Keras one.
Its parameters are one flat float32 CPU torch tensor, as the torch adapter's are, because the
parameter servers, the sync reducer and the checkpoints work on torch tensors. The flat vector is
the truth: before every forward pass the Keras variables are loaded from it (inside the compiled
step, a few in-graph copies), so whatever wrote into it (a pull from the servers, an optimizer
step on it in place, a broadcast) needs no notification. Gradients come from a
``tf.GradientTape`` in one ``tf.function``, concatenated and written into the caller's buffer.

TensorFlow and Keras are imported only through :func:`._frameworks.import_tf`, called here and in
:mod:`._keras_eval` when a Keras model is trained; ``import dask_train`` and torch jobs never load
them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dask_train.models._frameworks import import_tf


def _size(shape: Sequence[Any]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def flatten_variables(model: Any) -> np.ndarray:
    """A new flat float32 copy of the model's trainable variables (``trainable_weights`` order)."""
    parts = [np.asarray(v.numpy(), dtype=np.float32).reshape(-1) for v in model.trainable_weights]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def _is_float(dtype: Any) -> bool:
    return np.dtype(str(dtype)).kind == "f"


class KerasBuffers:
    """A Keras model's non-trainable weights (BatchNormalization's moving mean and variance) as
    one flat float64 vector: the contract of :class:`~dask_train.models._buffers.BufferSet`.

    ``model.non_trainable_weights`` excludes random seed states and metric state by Keras's own
    definition: a trainer's dropout stream stays its own (see :class:`KerasFlatModel`).

    Examples
    --------
    >>> KerasBuffers(keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization()])).size
    6
    """

    def __init__(self, model: Any) -> None:
        self.variables = [v for v in model.non_trainable_weights if _is_float(v.dtype)
                          or np.dtype(str(v.dtype)).kind in "iu"]
        self.size = sum(_size(v.shape) for v in self.variables)

    def __bool__(self) -> bool:
        return self.size > 0

    def gather(self) -> np.ndarray | None:
        """A new float64 copy of the buffers, or None for a model without any."""
        if not self.size:
            return None
        return np.concatenate([np.asarray(v.numpy(), dtype=np.float64).reshape(-1)
                               for v in self.variables])

    def scatter(self, values: np.ndarray | torch.Tensor | None) -> None:
        """Assign ``values`` (from :meth:`gather`, here or elsewhere) to the variables; None: no-op."""
        if values is None or not self.size:
            return
        src = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else \
            np.asarray(values)
        if src.size != self.size:
            raise ValueError(
                f"{src.size} buffer values for a model with {self.size}: they were saved for "
                "another model"
            )
        offset = 0
        for v in self.variables:
            n = _size(v.shape)
            v.assign(src[offset : offset + n].reshape(tuple(v.shape)).astype(str(v.dtype)))
            offset += n


class KerasFlatModel:
    """A Keras model whose trainable variables are loaded from one flat float32 CPU vector.

    The same interface as :class:`~dask_train.models._flat.FlatModel`: ``flat``, ``n_params``,
    ``params``, ``train_mode``, ``loss_fn``, ``batch``, ``gradient``, ``write_slices``,
    ``set_flat``, ``read_params``, ``buffers``, ``evaluate``; ``device`` is the CPU (where the
    flat vector lives; TensorFlow places the math) and ``scaler`` None.

    Parameters
    ----------
    model : keras.Model
        Built (it has its variables); used as is, so callers pass their own copy.

    Examples
    --------
    >>> fm = KerasFlatModel(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    >>> fm.n_params, fm.flat.dtype
    (8, torch.float32)
    """

    def __init__(self, model: Any, *, device: Any = None, precision: str | None = None) -> None:
        self.tf, _ = import_tf()
        self.module = model
        self.device = torch.device("cpu")
        self.precision = None  # the Trainer refuses mixed_precision= for Keras models
        self.scaler = None
        self.variables = list(model.trainable_weights)
        self.layout: list[tuple[int, int, tuple[int, ...]]] = []
        offset = 0
        for v in self.variables:
            shape = tuple(int(d) for d in v.shape)
            self.layout.append((offset, offset + _size(shape), shape))
            offset += _size(shape)
        self.flat = torch.from_numpy(flatten_variables(model))
        # Per-variable views of the flat vector, as torch tensors: the sync reducer cuts its
        # buckets at their boundaries (their .grad become views into its buffer).
        self.params = [torch.nn.Parameter(self.flat[a:b].view(shape)) for a, b, shape in self.layout]
        self._steps: dict[int, Any] = {}
        self._forward: Any = None

    @property
    def n_params(self) -> int:
        """Number of trainable values."""
        return int(self.flat.numel())

    def train_mode(self) -> None:
        """Give this copy's random layers (Dropout) a seed drawn from torch's RNG (trainers call
        this once; the forward pass itself is called with ``training=True``).

        Every role gets a copy of the same model, and with it the same seed states: two trainers
        would drop the same units. ``seed_trainer`` seeds torch per trainer before the copy is
        made, so drawing from torch gives each trainer its own, reproducible stream.
        """
        weights = {id(v) for v in self.module.weights}
        for v in self.module.variables:
            if id(v) not in weights and np.dtype(str(v.dtype)).kind in "iu" and _size(v.shape) == 2:
                seed = int(torch.randint(0, 2**31 - 1, (1,)))
                v.assign(np.array([seed, 0], dtype=str(v.dtype)))

    def loss_fn(self, loss: Any) -> Any:
        """The engines' loss for a Trainer's ``loss=`` (see :func:`._keras_eval.make_loss`)."""
        from dask_train.models._keras_eval import make_loss

        return make_loss(loss)

    def batch(self, x: np.ndarray, y: np.ndarray, w: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The batch as it is: the compiled step converts numpy arrays itself."""
        return x, y, w

    def _flat_tensor(self) -> Any:
        return self.tf.convert_to_tensor(self.flat.numpy())

    def _step(self, loss_fn: Any) -> Any:
        """The compiled training step for ``loss_fn``: load, forward, loss, flat gradient."""
        step = self._steps.get(id(loss_fn))
        if step is not None:
            return step
        tf, model, variables, layout = self.tf, self.module, self.variables, self.layout

        def run(flat: Any, x: Any, y: Any, w: Any = None) -> tuple[Any, Any]:
            for v, (a, b, shape) in zip(variables, layout):
                v.assign(tf.reshape(flat[a:b], shape))
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True), w)
            grads = tape.gradient(loss, variables)
            parts = [tf.zeros([b - a]) if g is None else
                     tf.reshape(tf.cast(tf.convert_to_tensor(g), tf.float32), [-1])
                     for g, (a, b, _) in zip(grads, layout)]
            return loss, (tf.concat(parts, axis=0) if parts else tf.zeros([0]))

        # reduce_retracing: a block's last, smaller batch would otherwise trace a second graph.
        step = tf.function(run, reduce_retracing=True)
        self._steps[id(loss_fn)] = step
        return step

    def gradient(self, x: np.ndarray, y: np.ndarray, loss_fn: Any, *, out: torch.Tensor,
                 w: np.ndarray | None = None) -> float:
        """Compute the loss on one batch and write the flat gradient into ``out``; return the loss."""
        step = self._step(loss_fn)
        loss, grad = step(self._flat_tensor(), x, y) if w is None else \
            step(self._flat_tensor(), x, y, w)
        np.copyto(out.numpy(), grad.numpy())
        return float(loss)

    def write_slices(self, parts: list[tuple[int, int, np.ndarray]]) -> None:
        """Copy received parameter slices ``(start, stop, values)`` into the flat vector."""
        dst = self.flat.numpy()
        for start, stop, values in parts:
            dst[start:stop] = np.asarray(values)

    def set_flat(self, values: np.ndarray | torch.Tensor, *, start: int = 0) -> None:
        """Copy ``values`` into the flat parameters from ``start`` and into the Keras variables
        (so the model can be used directly, as the Trainer's result is)."""
        src = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else \
            np.asarray(values)
        self.flat.numpy()[start : start + src.size] = src.reshape(-1)
        self.load()

    def load(self) -> None:
        """Assign the flat vector to the Keras variables (outside the compiled step)."""
        flat = self.flat.numpy()
        for v, (a, b, shape) in zip(self.variables, self.layout):
            v.assign(flat[a:b].reshape(shape).astype(str(v.dtype), copy=False))

    def read_params(self) -> np.ndarray:
        """A copy of the flat parameters."""
        return self.flat.numpy().copy()

    def buffers(self) -> KerasBuffers:
        """The model's non-trainable weights (BatchNormalization statistics) as one flat vector."""
        return KerasBuffers(self.module)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """The model's outputs on ``x`` in inference mode (``training=False``), as numpy."""
        if self._forward is None:
            model = self.module
            self._forward = self.tf.function(lambda x: model(x, training=False),
                                             reduce_retracing=True)
        return np.asarray(self._forward(x))

    def evaluate(self, x: np.ndarray, y: np.ndarray, *, loss: Any,
                 metrics: Mapping[str, Any] | None = None, batch_size: int = 4096
                 ) -> dict[str, float]:
        """Scores of the model on ``(x, y)`` (see :func:`._keras_eval.evaluate`)."""
        from dask_train.models._keras_eval import evaluate

        self.load()
        return evaluate(self.forward, x, y, loss=loss, metrics=metrics, batch_size=batch_size)


def warm_worker() -> str:
    """Dask task: import TensorFlow and Keras in this worker, in its thread pool.

    A Keras model unpickled on a worker that has not imported TensorFlow imports it on the
    worker's event loop (Dask deserializes task arguments as they arrive): 20 s or more here,
    during which the worker answers no heartbeat. Importing it first, as a task, avoids that.
    TensorFlow's thread pools follow ``TF_NUM_INTRAOP_THREADS`` / ``TF_NUM_INTEROP_THREADS``,
    which the dask-train worker plugin sets (see ``DaskTrainPlugin``).
    """
    from distributed import get_worker

    import_tf()
    return str(get_worker().address)


def warm_workers(client: Any, addresses: Sequence[str], *, timeout: float) -> None:
    """Run :func:`warm_worker` on every address (pinned tasks) and wait at most ``timeout`` s."""
    from distributed import as_completed

    from dask_train.errors import TrainingTimeout

    futures = [client.submit(warm_worker, workers=[a], allow_other_workers=False, pure=False,
                             key=f"dt-import-tensorflow-{i}-{os.urandom(4).hex()}")
               for i, a in enumerate(addresses)]
    try:
        # On this client's loop: distributed.wait (and as_completed without loop=) uses the
        # default client, which may be another one or none (set_as_default=False).
        for _ in as_completed(futures, loop=client.loop, timeout=timeout):
            pass
    except TimeoutError:
        late = [a for a, f in zip(addresses, futures) if not f.done()]
        client.cancel(futures)
        raise TrainingTimeout(
            f"importing TensorFlow on the workers {late} took longer than timeout={timeout:g} s; "
            "check that they are alive and not busy, or raise timeout="
        ) from None
    failed = [(a, f.exception()) for a, f in zip(addresses, futures) if f.status == "error"]
    if failed:
        from dask_train.errors import RoleFailed

        # A message, not the stored exception re-raised: its frames would pin the futures.
        raise RoleFailed("; ".join(f"importing TensorFlow on {a} failed: {type(e).__name__}: {e}"
                                   for a, e in failed))
