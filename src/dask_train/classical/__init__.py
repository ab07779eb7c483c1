"""Classical models by distributed loss and gradient sums: GLM estimators (scikit-learn API),
their full-batch solvers (L-BFGS, Newton, gradient descent, proximal gradient), and the building
block (:func:`distributed_loss_grad`). Never imports torch. The plumbing under them lives in the
layers below: the blocks in :mod:`dask_train.data` (``BlockSet``, ``persist_data``), the tree
reduction and parameter broadcast in :mod:`dask_train.runtime` (``tree_reduce``, ``send_params``).
"""

from dask_train.classical._glm_logistic import LogisticRegression
from dask_train.classical._glm_losses import GLMBlockLoss
from dask_train.classical._glm_regression import LinearRegression, PoissonRegression
from dask_train.classical.full_batch import distributed_loss_grad

__all__ = [
    "GLMBlockLoss",
    "LinearRegression",
    "LogisticRegression",
    "PoissonRegression",
    "distributed_loss_grad",
]
