"""Scoring, shared by every torch engine and the numpy one: :mod:`.scorer` (the scorer role),
:mod:`.keeper` (a score's record, recent snapshots, the scorer's schedule and budget) and
:mod:`.spread_eval` (a dask validation set scored where its blocks live)."""
