"""Imported last by the embedded cluster's fork server (see :mod:`dask_train.runtime._fork`).

Its import freezes the objects the server's imports made (``gc.freeze``): the garbage collector
no longer walks them, neither in the server nor in the workers forked from it, which inherit them
(Python's advice for a fork server, so that the collector does not touch, and copy, every page the
workers share with it). Without it the server spent 0.4 s of CPU in its interpreter's final
collection after the program had ended, torch's modules and all.
"""

import gc

gc.freeze()
