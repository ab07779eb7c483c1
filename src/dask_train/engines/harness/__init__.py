"""The worker side every trainer role shares: :mod:`.role` (``TrainerRole``: the feed, events,
pauses, the model on its device), :mod:`.stats` (each role's per-second stats events) and
:mod:`.control` (the controller's signals as the roles receive them: stop, pause, resume, shard
saves)."""
