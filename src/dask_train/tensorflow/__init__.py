"""TensorFlow on Dask: ``start_tensorflow`` stands TensorFlow servers up inside Dask workers.

Names load lazily, and TensorFlow itself only inside the functions that need it (in the workers'
tasks, and in the client when a ``tf.train.ClusterSpec`` is asked for): importing this package
costs nothing. Keras models train with the Trainer's own engines (``dt.Trainer(keras_model, ...)``);
this package is the lower layer for users' own TensorFlow code.
"""

from dask_train._lazy import attach

__getattr__, __dir__, __all__ = attach(__name__, {
    "TensorFlowCluster": "._start",
    "start_tensorflow": "._start",
})
