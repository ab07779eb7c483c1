"""How a user's model travels to the roles: pickled whole, with its parameter layout checked.

Dask's own serializer for ``torch.nn.Module`` (``distributed/protocol/torch.py``) copies a
module's attribute dictionary instead of pickling it. That loses what pickling keeps: an RNN's
weak references to its flat weights fail to serialize, and a Parameter shared by two modules
(tied weights) arrives as two, so a worker would train an untied copy of the model. A
:class:`ModulePayload` is what travels instead: the module as cloudpickle bytes (classes defined
in a script travel by value), and the layout of its trainable parameters -- count, shapes, and
which names share one tensor -- that every role checks the module it rebuilt against, so a
difference is a clear error before any step, never a silent untied copy.

A module that cannot be pickled (parametrizations such as ``weight_norm``: torch itself saves
them only through ``state_dict()``) travels as a factory: ``Trainer(make_net)``, a function
building the module, plus the client's ``state_dict()``, so every role starts from the client's
initial values.

Examples
--------
>>> import pickle, torch
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
>>> net[1].weight = net[0].weight                        # tied
>>> payload = ModulePayload.of(net)
>>> payload.layout.shared
[['0.weight', '1.weight']]
>>> copy = pickle.loads(pickle.dumps(payload)).module()
>>> copy[0].weight is copy[1].weight
True
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle


@dataclass(frozen=True)
class ParamLayout:
    """The trainable parameters of a module as the engines see them.

    ``names`` and ``shapes`` are in ``module.parameters()`` order (each shared tensor once);
    ``shared`` lists the groups of names bound to one tensor (tied weights).
    """

    names: list[str]
    shapes: list[tuple[int, ...]]
    shared: list[list[str]]

    @classmethod
    def of(cls, module: Any) -> ParamLayout:
        """The layout of a torch module (a Keras model has none to check: an empty layout)."""
        if not hasattr(module, "named_parameters"):
            return cls([], [], [])
        groups: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                groups.setdefault(id(p), []).append(name)
        names, shapes = [], []
        for name, p in module.named_parameters():
            if p.requires_grad:
                names.append(name)
                shapes.append(tuple(p.shape))
        return cls(names, shapes, [g for g in groups.values() if len(g) > 1])

    @property
    def n_params(self) -> int:
        """The number of trainable values (each shared tensor counted once)."""
        total = 0
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def difference(self, other: ParamLayout) -> str:
        """How ``other`` differs from this layout, in words ("" when it does not)."""
        if self == other:
            return ""
        if self.shared != other.shared:
            return (f"tied parameters {self.shared} on the client but {other.shared} here "
                    "(a shared tensor arrived as separate copies)")
        if self.names != other.names:
            return f"{len(self.names)} parameter tensors on the client, {len(other.names)} here"
        shapes = [f"{n}: {a} vs {b}" for n, a, b in zip(self.names, self.shapes, other.shapes)
                  if a != b]
        return "shapes differ: " + "; ".join(shapes[:3])


class ModulePayload:
    """A model on its way to the roles (see the module docstring).

    Build it with :meth:`of` in the client; a role calls :meth:`module` for its copy, which is
    checked against the client's layout.
    """

    def __init__(self, *, blob: bytes | None, factory: Callable[[], Any] | None,
                 state: bytes | None, layout: ParamLayout, name: str) -> None:
        self.blob, self.factory, self.state = blob, factory, state
        self.layout, self.name = layout, name
        self._module: Any = None  # the unpickled module, once per process

    @classmethod
    def of(cls, module: Any, factory: Callable[[], Any] | None = None) -> ModulePayload:
        """The payload of ``module`` (pickled), or of ``factory`` and ``module``'s state.

        Raises
        ------
        TypeError
            When ``module`` cannot be pickled and no factory was given; the message names the
            module and the fix.
        """
        layout, name = ParamLayout.of(module), type(module).__name__
        if factory is not None:
            return cls(blob=None, factory=factory, state=_state_bytes(module), layout=layout,
                       name=name)
        try:
            blob = dumps_by_value(module)
        except Exception as exc:
            raise TypeError(
                f"module={name} cannot be pickled to travel to the Dask workers ({type(exc).__name__}: "
                f"{str(exc)[:200]}). Modules with parametrizations (weight_norm, spectral_norm, "
                "orthogonal) are saved by torch only through state_dict(): pass a function that "
                "builds the model instead, e.g. dt.Trainer(make_net, ...) with "
                "def make_net(): return ...; every worker builds it and loads the client's "
                "initial state_dict()."
            ) from None
        return cls(blob=blob, factory=None, state=None, layout=layout, name=name)

    @property
    def nbytes(self) -> int:
        """Bytes it travels as (the pickled module, or the factory's state)."""
        return len(self.blob if self.blob is not None else self.state or b"")

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled by value, never through Dask's attribute-copying serializer for modules; the
        # factory with cloudpickle (a function defined in a script travels by value).
        factory = None if self.factory is None else dumps_by_value(self.factory)
        return (_rebuild, (self.blob, factory, self.state, self.layout, self.name))

    def build(self) -> Any:
        """A new module: unpickled, or built by the factory and loaded with the state."""
        if self.blob is not None:
            return cloudpickle.loads(self.blob)
        assert self.factory is not None and self.state is not None
        module = self.factory()
        import torch

        module.load_state_dict(torch.load(io.BytesIO(self.state), weights_only=True))
        return module

    def module(self) -> Any:
        """This process's module, checked against the client's layout (built once).

        Raises
        ------
        ValueError
            When the module rebuilt here does not have the client's parameter layout.
        """
        if self._module is None:
            module = self.build()
            problem = self.layout.difference(ParamLayout.of(module))
            if problem:
                raise ValueError(
                    f"module={self.name} arrived on this worker with another parameter layout "
                    f"than the client's: {problem}. A model whose parameters are created at "
                    "random or lazily in forward() cannot be copied: build every parameter in "
                    "__init__."
                )
            self._module = module
        return self._module


def _own_modules(*objs: Any) -> list[Any]:
    """The Python modules defining ``objs`` (or the function a ``functools.partial`` wraps) that
    are the user's own files, not installed packages: a worker may not be able to import them
    (``mymodels.py`` beside a script or a config), so their code travels by value."""
    import functools
    import sys
    import sysconfig

    installed = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    found = []
    for obj in objs:
        obj = obj.func if isinstance(obj, functools.partial) else obj
        name = getattr(obj, "__module__", None) or type(obj).__module__
        module = sys.modules.get(name or "")
        path = getattr(module, "__file__", None)
        if module is None or name == "__main__" or path is None or \
                any(path.startswith(p) for p in installed) or name.startswith("dask_train"):
            continue
        found.append(module)
    return found


#: cloudpickle's by-value registry is one for the process: pickling under it is serialized (the
#: trials of a search build and send their models from threads at once).
_BY_VALUE = threading.Lock()


def dumps_by_value(obj: Any, *also: Any) -> bytes:
    """cloudpickle bytes of ``obj``, with the user's own modules defining ``obj`` (and ``also``)
    pickled by value (see :func:`_own_modules`); modules the user registered stay registered."""
    with _BY_VALUE:
        already = set(cloudpickle.list_registry_pickle_by_value())
        modules = [m for m in _own_modules(obj, *also) if m.__name__ not in already]
        for module in modules:
            cloudpickle.register_pickle_by_value(module)
        try:
            return bytes(cloudpickle.dumps(obj, protocol=5))
        finally:
            for module in modules:
                cloudpickle.unregister_pickle_by_value(module)


def _state_bytes(module: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    return buffer.getvalue()


def _rebuild(blob: bytes | None, factory: bytes | None, state: bytes | None, layout: ParamLayout,
             name: str) -> ModulePayload:
    return ModulePayload(blob=blob, factory=None if factory is None else cloudpickle.loads(factory),
                         state=state, layout=layout, name=name)


def unwrap(module: Any) -> Any:
    """The module a role trains: a payload's (checked), or ``module`` as it came."""
    return module.module() if isinstance(module, ModulePayload) else module


def travelling(module: Any, factory: Callable[[], Any] | None = None) -> Any:
    """What is sent to the roles for ``module``: a :class:`ModulePayload` for a torch module (a
    payload already built is sent as it is), anything else as it is (a Keras model has its own
    serializer, an ArrayModel is plain data)."""
    import torch

    if not isinstance(module, torch.nn.Module):
        return module
    return ModulePayload.of(module, factory)


def as_sent(payload: Any) -> Any:
    """Dask task: ``payload`` as it came (the task that makes a model a graph key; here, in a
    module every role imports anyway, so running it imports nothing more on a worker)."""
    return payload
