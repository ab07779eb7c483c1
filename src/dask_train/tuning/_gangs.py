"""Gang reservation of workers for concurrent trials (pure, tested without a cluster).

A trial that needs k workers takes all k at once or none. Two distributed trials that each took
half of what they need would wait for each other forever; taking a whole gang in one step, in one
place (the search's own loop), makes that impossible. A gang that ran a trial before is taken
again when it is free, so the data persisted on it for that trial is reused.
"""

from __future__ import annotations

from collections.abc import Iterable


class Reservations:
    """Which workers running trials hold.

    Examples
    --------
    >>> book = Reservations()
    >>> book.take(["a", "b", "c", "d"], need=2, trial=0)
    ['a', 'b']
    >>> book.take(["a", "b", "c", "d"], need=3, trial=1) is None   # only c, d are free
    True
    >>> book.take(["a", "b", "c", "d"], need=2, trial=1)
    ['c', 'd']
    >>> book.give_back(0); book.take(["a", "b", "c", "d"], need=2, trial=2)
    ['a', 'b']
    """

    def __init__(self) -> None:
        self.held: dict[int, tuple[str, ...]] = {}
        self.used: list[tuple[str, ...]] = []

    def busy(self) -> set[str]:
        """Every worker some trial holds."""
        return {w for gang in self.held.values() for w in gang}

    def free(self, alive: Iterable[str]) -> list[str]:
        """Live workers no trial holds, sorted."""
        busy = self.busy()
        return sorted(w for w in set(alive) if w not in busy)

    def take(self, alive: Iterable[str], *, need: int, trial: int) -> list[str] | None:
        """Reserve ``need`` free live workers for ``trial``, all at once; None if there are fewer.

        A gang used before is preferred while all of it is free (its data is already there);
        otherwise the first free workers in address order.
        """
        if need < 1:
            raise ValueError(f"need={need} must be >= 1")
        free = self.free(alive)
        if len(free) < need:
            return None
        free_set = set(free)
        gang = next((g for g in self.used if len(g) == need and set(g) <= free_set), None)
        if gang is None:
            gang = tuple(free[:need])
            self.used.append(gang)
        self.held[trial] = gang
        return list(gang)

    def give_back(self, trial: int) -> None:
        """Release the workers ``trial`` held (a no-op when it held none)."""
        self.held.pop(trial, None)
