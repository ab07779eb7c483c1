"""The measurements ``strategy="auto"`` and ``ps="auto"`` decide from (the decisions themselves
are pure policies in :mod:`dask_train.policy`): :mod:`.step` (each candidate's whole step, run as
it will run on one machine), :mod:`.cores` (the cores trainers really get) and :mod:`.ps_costs`
(an async-ps job's per-step costs for the cost model)."""
