"""How the cluster's changes reach a job, on the client: a generation's pass looks at them
(:mod:`._liveness`); a worker that leaves with notice is handed over (:mod:`._departures`), a
lost one decided on by the failure policy (:mod:`._losses`), the workers a job lacks asked for
(:mod:`._wanted`). Each reads the workers from one
:class:`~dask_train.runtime._cluster_view.ClusterView`; the worker side of a notice (holding a
closing worker for its hand-over) is :mod:`dask_train.runtime._plugin`'s."""
