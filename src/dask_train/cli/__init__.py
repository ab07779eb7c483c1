"""Command line: ``dask-train`` (the entry point ``dask_train.cli.main:main``), also run as
``python -m dask_train.cli``.

The package imports nothing of its own: ``python -m dask_train.cli.main`` runs ``main`` as a
fresh ``__main__`` module, which Python warns about (``found in sys.modules``) when the
package has imported it first.
"""
