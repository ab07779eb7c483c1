"""The client side every engine whose trainers are long-running pinned tasks shares (async-ps, sync
torch, ``dt.run``): :mod:`.base` (``RoleEngine``: roles pinned to their workers, feeding, the
shared scorer, pauses, shard saves), :mod:`.granting` (the ledger's blocks handed to trainers),
:mod:`.sending` (the model sent to the cluster) and :mod:`.waiting` (waiting on holders' tasks
without waiting on a dead holder)."""
