"""Prediction over dask collections: the model sent once per worker, rows predicted where they live."""

from dask_train.prediction._predict import TORCH_METHODS, predict

__all__ = ["TORCH_METHODS", "predict"]
