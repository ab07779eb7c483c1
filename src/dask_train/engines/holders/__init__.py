"""Parameter holders and how roles reach them: :mod:`.shard` (a server shard's state),
:mod:`.optim` (a flat vector with its optimizer), :mod:`.host_memory` (shards in ``/dev/shm``
that trainers of one host update themselves), :mod:`.params` (pushes and pulls from a role's
thread), :mod:`.push_socket` (the direct TCP path for pushes) and :mod:`.reach` (finding a holder
on its worker)."""
