"""Adapters between an ML framework and the engines: torch (flat parameter views, losses,
optimizers, evaluation) and numpy (:class:`ArrayModel`). Names load lazily: the numpy adapter
never imports torch.
"""

from dask_train._lazy import attach

_TORCH = ("CLASSIFICATION_LOSSES", "LOSSES", "OPTIMIZERS", "Shard", "build_optimizer",
          "flatten_parameters", "make_loss", "split_shards")
__getattr__, __dir__, __all__ = attach(__name__, {
    "ArrayModel": "._array",
    "softmax_regression": "._array",
    "FlatModel": "._flat",
    "flat_model": "._flat",
    "evaluate": "._evaluate",
    "metric_names": "._evaluate",
    **{name: "._torch" for name in _TORCH},
})
