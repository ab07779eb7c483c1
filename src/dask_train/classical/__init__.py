"""Classical models by distributed loss and gradient sums: GLM estimators (scikit-learn API),
their full-batch solvers (L-BFGS, Newton, gradient descent, proximal gradient), and the building
blocks (:func:`tree_reduce`, :func:`distributed_loss_grad`). Never imports torch.
"""

from dask_train.classical._glm import LinearRegression, LogisticRegression, PoissonRegression
from dask_train.classical._glm_losses import GLMBlockLoss
from dask_train.classical.full_batch import (
    BlockData,
    distributed_loss_grad,
    persist_data,
    tree_reduce,
)

__all__ = [
    "BlockData",
    "GLMBlockLoss",
    "LinearRegression",
    "LogisticRegression",
    "PoissonRegression",
    "distributed_loss_grad",
    "persist_data",
    "tree_reduce",
]
