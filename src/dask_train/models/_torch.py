"""The torch adapter's pieces: losses, optimizers on flat shards, flat parameter copies.

The model adapter the engines use (flat views on a device, gradients, mixed precision) is
:mod:`._flat`; evaluation is :mod:`._evaluate`.

Every optimizer offered here is element-wise (SGD, Adam, AdamW, RMSprop, Adagrad), so applying it to
contiguous slices of one flat parameter vector is exactly the same as applying it to the module's
tensors. That is what lets parameter servers hold balanced flat shards.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dask_train.policy._settings import OptimizerSettings

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: Losses by name; classification losses also report accuracy.
LOSSES: dict[str, LossFn] = {
    "cross_entropy": torch.nn.functional.cross_entropy,
    "nll": torch.nn.functional.nll_loss,
    "mse": torch.nn.functional.mse_loss,
    "l1": torch.nn.functional.l1_loss,
}
CLASSIFICATION_LOSSES = frozenset({"cross_entropy", "nll"})

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
}


def resolve_loss(loss: Any) -> LossFn:
    """The loss function of a Trainer's ``loss=``: a name, an ``nn.Module``, or a callable.

    Examples
    --------
    >>> resolve_loss("mse") is torch.nn.functional.mse_loss
    True
    """
    if isinstance(loss, str):
        return LOSSES[loss]
    fn: LossFn = loss
    return fn


#: A loss the engines call: ``fn(output, target, weight)`` -> the batch loss, a scalar tensor.
#: ``weight`` is the batch's sample weights or None.
WeightedLossFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def takes_weights(loss: Any) -> bool:
    """Whether ``loss`` can weigh samples: a name, a torch loss module with ``reduction``, or a
    function taking a third argument ``fn(output, target, weight)``."""
    if isinstance(loss, str) or isinstance(getattr(loss, "reduction", None), str):
        return True
    try:
        params = inspect.signature(loss).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


def model_inputs(x: Any, device: Any = None) -> Any:
    """A numpy batch as the model takes it, on ``device``: a tensor, or for several inputs (a
    record array, see :mod:`dask_train.data._inputs`) a dict of tensors by name, or a tuple of
    them in order for a tuple's inputs (fields ``"*0"``, ``"*1"``...).

    Examples
    --------
    >>> from dask_train.data._inputs import named, pack
    >>> batch = model_inputs(pack(named((np.zeros((2, 3)), np.arange(2)))))
    >>> type(batch).__name__, [tuple(t.shape) for t in batch]
    ('tuple', [(2, 3), (2,)])
    """
    def move(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        if device is None or torch.device(device).type == "cpu":
            return t
        # From pageable memory the copy waits for the device's queue (the previous step) to
        # drain; from pinned memory it is queued behind it. Pinned blocks come from torch's
        # caching host allocator, which reuses one only once its copy is done.
        return t.pin_memory().to(device, non_blocking=True)

    if isinstance(x, np.ndarray) and x.dtype.names is not None:
        if all(name.startswith("*") for name in x.dtype.names):  # data._inputs.POSITIONAL
            return tuple(move(x[name]) for name in x.dtype.names)
        return {name: move(x[name]) for name in x.dtype.names}
    return move(x) if isinstance(x, np.ndarray) else x


def call_module(module: Any, inputs: Any) -> Any:
    """``module(inputs)``; ``module(**inputs)`` for several inputs by name, ``module(*inputs)``
    for a tuple's."""
    if isinstance(inputs, dict):
        return module(**inputs)
    return module(*inputs) if isinstance(inputs, tuple) else module(inputs)


def batch_rows(batch: Any) -> int:
    """The rows of a batch as :func:`model_inputs` gives it: a tensor's length, or the length of
    the first of several inputs or targets (``len`` of a dict counts its keys)."""
    if isinstance(batch, Mapping):
        batch = next(iter(batch.values()))
    elif isinstance(batch, tuple):
        batch = batch[0]
    return len(batch)


def primary_output(out: Any) -> torch.Tensor:
    """The tensor that built-in losses, accuracy and predictions read from a model's output.

    A tensor is itself; a mapping (a dict, a Hugging Face ``ModelOutput``) gives its
    ``"logits"``, or its one tensor; a tuple or list its first element (an RNN's output, a Hugging
    Face model with ``return_dict=False``). A loss function of your own gets the whole output
    and picks what it needs.

    Examples
    --------
    >>> primary_output({"logits": torch.ones(2, 3), "hidden": None}).shape
    torch.Size([2, 3])

    Raises
    ------
    TypeError
        For an output with no one tensor to read; the message says what to do.
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        if isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        tensors = [v for v in out.values() if isinstance(v, torch.Tensor)]
        if len(tensors) == 1:
            return tensors[0]
        raise TypeError(
            f"the model returned a {type(out).__name__} with {sorted(out)} and no 'logits': "
            "return the predictions under 'logits', or pass loss=fn(output, target) that picks "
            "what it needs (and dt.predict(..., output=name))")
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"the model returned {type(out).__name__}: return a tensor of predictions, a "
                    "mapping with 'logits', or a tuple whose first element is the predictions")


def select_output(out: Any, output: Any = None) -> torch.Tensor:
    """``output`` of a model's output: a field's name, a function of the output, or (None) the
    :func:`primary_output`."""
    if output is None:
        return primary_output(out)
    if callable(output):
        picked: torch.Tensor = output(out)
        return picked
    if isinstance(out, Mapping):
        return out[output]  # type: ignore[no-any-return]
    return getattr(out, str(output))  # type: ignore[no-any-return]


def make_loss(loss: Any, *, device: Any = None) -> WeightedLossFn:
    """The engines' loss of a Trainer's ``loss=``: ``fn(output, target, weight=None)``.

    Without weights it is the loss as given (a batch mean). With sample weights it is
    ``sum(weight_i * loss_i) / batch_rows`` (Keras's "sum over batch size"): over an epoch that
    minimises the weighted sum of per-sample losses. Per-sample losses come from
    ``reduction="none"`` (a name or a loss module) or from the function's own third argument.
    A loss module (with class weights, say) is moved to ``device``.
    """
    if isinstance(loss, torch.nn.Module) and device is not None:
        loss = loss.to(device)
    plain = resolve_loss(loss)
    if isinstance(loss, str):
        named: Any = LOSSES[loss]
        per_sample: Callable[..., torch.Tensor] | None = functools.partial(named, reduction="none")
    elif isinstance(getattr(loss, "reduction", None), str):
        per_sample = copy.copy(loss)
        per_sample.reduction = "none"  # type: ignore[union-attr]
    else:
        per_sample = None

    builtin = isinstance(loss, (str, torch.nn.Module))

    def fn(output: Any, target: torch.Tensor, weight: torch.Tensor | None = None
           ) -> torch.Tensor:
        if builtin:  # a named loss or a loss module reads the predictions (float32)
            output = primary_output(output)
            output = output.float() if output.is_floating_point() else output
        if weight is None:
            return plain(output, target)
        if per_sample is None:
            value: torch.Tensor = loss(output, target, weight)
            return value
        values = per_sample(output, target)
        values = values.reshape(len(output), -1).mean(dim=1)  # multi-output: per-row mean
        return (values * weight.to(values.dtype)).sum() / max(1, len(output))

    return fn


def is_classification(loss: Any) -> bool:
    """Whether ``loss`` takes class labels (so accuracy is reported): the names
    ``cross_entropy``/``nll``, or a ``CrossEntropyLoss``/``NLLLoss`` module."""
    if isinstance(loss, str):
        return loss in CLASSIFICATION_LOSSES
    return isinstance(loss, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss))


def loss_name(loss: Any) -> str:
    """A short name for messages and manifests: the name, or the object's class or function."""
    if isinstance(loss, str):
        return loss
    return type(loss).__name__ if isinstance(loss, torch.nn.Module) else \
        getattr(loss, "__qualname__", type(loss).__name__)


#: Optimizers with a fused kernel in torch, used unless the options choose an implementation.
_FUSED = frozenset({"sgd", "adam", "adamw"})


@dataclass(frozen=True)
class Shard:
    """A contiguous slice ``[start, stop)`` of the flat parameter vector held by one server."""

    index: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        """Number of parameters in the shard."""
        return self.stop - self.start


def split_shards(n_params: int, n_shards: int) -> list[Shard]:
    """Split a flat vector of ``n_params`` into ``n_shards`` contiguous, balanced slices.

    Element-wise optimizers make any split exact, so contiguous equal slices balance the servers'
    memory and optimizer work to within one parameter, better than assigning whole tensors greedily.

    Examples
    --------
    >>> [(s.start, s.stop) for s in split_shards(10, 3)]
    [(0, 4), (4, 7), (7, 10)]
    """
    if n_shards < 1:
        raise ValueError(f"n_shards={n_shards} must be >= 1")
    n_shards = min(n_shards, max(n_params, 1))
    base, extra = divmod(n_params, n_shards)
    shards, start = [], 0
    for i in range(n_shards):
        stop = start + base + (1 if i < extra else 0)
        shards.append(Shard(i, start, stop))
        start = stop
    return shards


def flatten_parameters(module: torch.nn.Module) -> torch.Tensor:
    """Copy the module's trainable parameters into one new flat float32 vector."""
    params = [p.detach().reshape(-1).to(torch.float32) for p in trainable(module)]
    if not params:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat(params)


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that receive gradients, in ``module.parameters()`` order."""
    return [p for p in module.parameters() if p.requires_grad]


_LIGHT_OPTIMIZERS: dict[type, type] = {}


def without_dynamo(cls: type) -> type:
    """A subclass of the torch optimizer class ``cls`` whose construction, steps and state dicts
    never import ``torch._dynamo``; the same name, state and arithmetic as ``cls``.

    Missing public API: every built-in torch optimizer imports ``torch._dynamo`` the first time
    it is built (``add_param_group`` is wrapped by ``torch._disable_dynamo``, which imports it
    on first call) and stepped (``_use_grad_for_differentiable`` calls
    ``torch._dynamo.graph_break()``): 1.9 s of CPU per process here, paid by every parameter
    server and sync rank at start-up, on the same cores as the data loading. Both wrappers only
    matter inside ``torch.compile``, and a shard's optimizer is never compiled. So the subclass
    calls the functions they wrap (``inspect.unwrap``, through the ``functools.wraps`` chain),
    with autograd set as the wrapper would set it. The subclass keeps ``cls.__name__``: a
    checkpoint names its optimizer by class name.
    """
    light = _LIGHT_OPTIMIZERS.get(cls)
    if light is not None:
        return light
    base = torch.optim.Optimizer
    overrides: dict[str, Any] = {}
    for name in ("add_param_group", "state_dict", "load_state_dict", "zero_grad"):
        if getattr(cls, name) is getattr(base, name):
            overrides[name] = inspect.unwrap(getattr(base, name))
    raw_step = inspect.unwrap(cls.step)  # type: ignore[attr-defined]

    fast = _fused_adam_step if issubclass(cls, torch.optim.Adam) else None

    def step(self: Any, closure: Any = None) -> Any:
        if fast is not None and closure is None and fast(self):
            return None
        with torch.set_grad_enabled(bool(self.defaults.get("differentiable", False))):
            return raw_step(self, closure)

    step.__doc__ = raw_step.__doc__
    # Marked as already hooked, torch's __init__ leaves it unwrapped: its profile_hook_step
    # opens a profiler record_function and walks the step hooks every step, 6% of an async-ps
    # trainer's step on the digits MLP (py-spy). These optimizers are the engines' own: no user
    # registers step hooks on them.
    step.hooked = True  # type: ignore[attr-defined]
    overrides["step"] = step
    light = type(cls.__name__, (cls,), {**overrides, "__module__": cls.__module__,
                                        "__qualname__": cls.__qualname__})
    _LIGHT_OPTIMIZERS[cls] = light
    return light


def _fused_adam_step(opt: Any) -> bool:
    """One step of a fused Adam or AdamW over one CPU tensor (a shard, a rank's flat vector)
    with the kernel torch's own step ends in; False (nothing done) where that is not the case,
    and the step is torch's.

    The same arithmetic as ``Adam.step`` with ``fused=True``, which for one tensor adds one to
    its step count and calls ``torch._fused_adam_`` (``_fused_adamw_``), after grouping the
    tensors by device and gathering each group's lists in Python: 18.5 us of a 20 us step on the
    digits MLP's 7,510 parameters, against 6 us called directly. The state must exist (the
    first step is torch's, which creates it) and the hyper-parameters are read from the group
    at every step, so a changed learning rate applies as it would.
    """
    groups = opt.param_groups
    if len(groups) != 1:
        return False
    group = groups[0]
    params = group["params"]
    if len(params) != 1 or not group["fused"] or group["differentiable"] or group["capturable"]:
        return False
    param = params[0]
    grad = param.grad
    state = opt.state.get(param)
    if grad is None or not state or grad.is_sparse or param.device.type != "cpu" \
            or getattr(opt, "grad_scale", None) is not None \
            or getattr(opt, "found_inf", None) is not None:
        return False
    lr, (beta1, beta2) = group["lr"], group["betas"]
    if isinstance(lr, torch.Tensor) or isinstance(beta1, torch.Tensor) \
            or isinstance(beta2, torch.Tensor):
        return False  # torch's step turns these into scalars its own way
    step = state["step"]
    amsgrad = bool(group["amsgrad"])
    step.add_(1)
    kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
    kernel([param], [grad], [state["exp_avg"]], [state["exp_avg_sq"]],
           [state["max_exp_avg_sq"]] if amsgrad else [], [step], amsgrad=amsgrad, lr=lr,
           beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
           maximize=group["maximize"], grad_scale=None, found_inf=None)
    return True


def build_optimizer(optim: OptimizerSettings, params: Sequence[torch.Tensor]
                    ) -> torch.optim.Optimizer:
    """Build ``optim`` (its name, or a ``torch.optim.Optimizer`` subclass, with its lr and
    options) over ``params`` (a server's flat shard)."""
    name: Any = optim.name
    lr, options = optim.lr, optim.options
    cls: Any = OPTIMIZERS[name] if isinstance(name, str) else name
    name = name if isinstance(name, str) else \
        {c: n for n, c in OPTIMIZERS.items()}.get(cls, cls.__name__)
    if cls in OPTIMIZERS.values():
        # A built-in: the same class that never imports torch._dynamo (2 s a process, see
        # without_dynamo). A user's own class is built as given.
        cls = without_dynamo(cls)
    opts = dict(options)
    if name in _FUSED and not {"fused", "foreach", "differentiable"} & opts.keys():
        # One kernel over the flat shard instead of a dozen tensor ops: Adam on 1.1M parameters
        # took 2.3 ms a step fused against 5.9 ms, and 150 against 228 us on 7,000 (one thread).
        try:
            return cls(params, lr=lr, fused=True, **opts)  # type: ignore[no-any-return]
        except (RuntimeError, TypeError, ValueError):
            pass  # a torch or a device without the fused kernel: the default implementation
    return cls(params, lr=lr, **opts)  # type: ignore[no-any-return]
