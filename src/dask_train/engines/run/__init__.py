"""``dt.run``: the user's own training function on every rank, under the one controller.

Client side: :mod:`.engine`; worker side: :mod:`.rank` (the rank's task) and :mod:`.context`
(the ``ctx`` the function gets)."""
