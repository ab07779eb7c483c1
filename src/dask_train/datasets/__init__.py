"""Data sets for examples, tests and benchmarks, generated on the workers.

Examples
--------
>>> from dask_train.datasets import digits, digits_test
>>> X, y = digits(1_000, chunks=500)
>>> X_test, y_test = digits_test()
"""

from dask_train.datasets._digits import digits, digits_test, digits_train

__all__ = ["digits", "digits_test", "digits_train"]
