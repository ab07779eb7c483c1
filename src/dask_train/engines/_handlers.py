"""The engines' RPC handlers, registered with the worker plugin by name, in one place.

The plugin a client registers carries every handler registered in that process
(:func:`dask_train.runtime._plugin.register_handler`); each worker imports a handler's module at
its first call. Registered here, when :mod:`dask_train.engines` is imported, not by each module
at its own import: a client that never imports a handler's module (a ``dt.run`` client imports
no torch, and the scorer's modules import it) still gives its workers the handler their roles
call each other by.
"""

from __future__ import annotations

from dask_train.runtime._plugin import register_handler

_ENGINES = "dask_train.engines"
for name, target in {
    "dask_train_endpoint": "holders.push_socket:make_endpoint_handler",
    "dask_train_pull": "holders.reach:make_pull_handler",
    "dask_train_push": "ps.server:make_push_handler",
    "dask_train_evaluate": "scoring.spread_eval:make_evaluate_handler",
    "dask_train_echo": "measure.ps_costs:make_echo_handler",
}.items():
    register_handler(name, f"{_ENGINES}.{target}")
