"""Adapters between an ML framework and the engines: torch (flat parameter views, losses,
optimizers, evaluation) and numpy (:class:`ArrayModel`). Names load lazily: the numpy adapter
never imports torch.
"""

from dask_train._lazy import attach

_TORCH = ("CLASSIFICATION_LOSSES", "LOSSES", "OPTIMIZERS", "FlatModel", "Shard", "build_optimizer",
          "evaluate", "flatten_parameters", "split_shards")
__getattr__, __dir__, __all__ = attach(__name__, {
    "ArrayModel": "._array",
    "softmax_regression": "._array",
    **{name: "._torch" for name in _TORCH},
})
