"""The model a fit trains: the user's module, or the one their factory builds.

``Trainer(make_net)`` takes a function that builds the model, as ``dt.search`` does. The client
builds one instance (seeded by the Trainer's ``seed``, the caller's RNG left as it was) to check
and size the job; the roles build their own with the same function and load that instance's
``state_dict()``, so every role starts from the same values. That is the way for a model that
cannot be pickled (parametrizations such as ``weight_norm``; see
:mod:`dask_train.models._transport`).
"""

from __future__ import annotations

import pickle
from typing import Any

from dask_train.errors import InvalidInput
from dask_train.models._array import ArrayModel
from dask_train.models._frameworks import is_keras_model
from dask_train.models._transport import ModulePayload


def is_factory(module: Any) -> bool:
    """Whether ``module`` is a function that builds the model (not a model itself)."""
    import torch

    return callable(module) and not isinstance(module, (torch.nn.Module, ArrayModel)) \
        and not is_keras_model(module)


def build_from(factory: Any, *, seed: int) -> Any:
    """The model ``factory()`` builds, with torch's RNG seeded by ``seed`` for it alone.

    Raises
    ------
    InvalidInput
        When the factory raises, or returns something that is not a model.
    """
    import torch

    name = getattr(factory, "__name__", type(factory).__name__)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        try:
            module = factory()
        except Exception as exc:
            raise InvalidInput([f"module={name}: calling it to build the model raised "
                                f"{type(exc).__name__}: {exc}"]) from exc
    if not isinstance(module, torch.nn.Module):
        raise InvalidInput([f"module={name} returned {type(module).__name__}: a model factory "
                            "must return a torch.nn.Module."])
    return module


def travel_problems(module: Any, factory: Any = None) -> list[str]:
    """Problems with sending ``module`` to the roles, found by doing it once in the client:
    it pickles (or comes from ``factory``), and comes back with the same parameter layout."""
    import torch

    if not isinstance(module, torch.nn.Module):
        return []
    try:
        payload = ModulePayload.of(module, factory)
        pickle.loads(pickle.dumps(payload)).module()
    except (TypeError, ValueError) as exc:
        return [str(exc)]
    except Exception as exc:  # the user's class fails to unpickle, or its factory to rebuild
        return [f"module={type(module).__name__} does not survive the trip to the workers: "
                f"{type(exc).__name__}: {exc}"]
    return []
