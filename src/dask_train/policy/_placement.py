"""Role placement: which Dask worker runs each parameter server, trainer and scorer (pure)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dask_train.errors import InvalidInput

# Relative load of a role on its process, used to spread roles when they must share workers:
# a trainer computes all the time, a server applies updates, a scorer wakes once a second.
_WEIGHT = {"trainer": 1.0, "ps": 0.5, "scorer": 0.25}
#: The kinds of role, in the order they are placed: ``"trainer"`` (an async-ps trainer, a sync
#: or ``dt.run`` rank), ``"ps"`` a parameter server, ``"scorer"`` the scorer. The one definition:
#: failures, placement and TensorFlow's cluster read it.
KINDS = ("trainer", "ps", "scorer")
#: The seed's name for trainers, kept where its API has it: ``start_roles(worker=)`` and
#: ``roles["worker"]``, TensorFlow's ``TF_CONFIG`` and a checkpoint written before trainers were
#: called trainers. :class:`Roles` reads it as ``"trainer"``.
SEED_TRAINER = "worker"


def _kind(kind: str) -> str:
    return "trainer" if kind == SEED_TRAINER else kind


class Roles(Mapping[str, list[str]]):
    """Placement of a job's roles: role kind -> list of Dask worker addresses (one per instance).

    A read-only mapping over the kinds it was given (``"ps"``, ``"trainer"``, ``"scorer"``),
    with ``in``, ``len``, iteration and ``items()``. Looking up a kind it does not hold raises
    ``KeyError``, as any mapping does; use ``roles.get("ps", [])`` where a kind may be absent.
    ``"worker"``, the seed's name for trainers (``start_roles(worker=2)``), reads and writes
    ``"trainer"``.

    Examples
    --------
    >>> roles = Roles({"ps": ["tcp://a:1"], "worker": ["tcp://a:1", "tcp://b:2"], "scorer": []})
    >>> roles["trainer"][1], roles["worker"] == roles["trainer"], roles.addresses
    ('tcp://b:2', True, ['tcp://a:1', 'tcp://b:2'])
    >>> "ps" in roles, "chief" in roles, len(roles), list(roles)
    (True, False, 3, ['ps', 'trainer', 'scorer'])
    """

    def __init__(self, placement: Mapping[str, Sequence[str]] | None = None) -> None:
        self._placement = {_kind(str(k)): tuple(v) for k, v in (placement or {}).items()}

    @property
    def placement(self) -> dict[str, list[str]]:
        """A plain ``dict`` copy: role kind -> worker addresses."""
        return {k: list(v) for k, v in self._placement.items()}

    def __getitem__(self, kind: str) -> list[str]:
        return list(self._placement[_kind(kind)])

    def __iter__(self) -> Iterator[str]:
        return iter(self._placement)

    def __len__(self) -> int:
        return len(self._placement)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Roles):
            return self._placement == other._placement
        return Mapping.__eq__(self, other)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._placement.items())))

    def replace(self, kind: str, addresses: Sequence[str]) -> Roles:
        """A copy with ``kind`` placed on ``addresses``."""
        return Roles({**self._placement, _kind(kind): tuple(addresses)})

    @property
    def addresses(self) -> list[str]:
        """Every worker address that holds at least one role, sorted."""
        return sorted({a for addrs in self._placement.values() for a in addrs})

    def names_on(self, address: str) -> list[str]:
        """Role names (``"ps-0"``, ``"trainer-1"``) placed on ``address``."""
        return [
            f"{kind}-{i}"
            for kind, addrs in self._placement.items()
            for i, a in enumerate(addrs)
            if a == address
        ]

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={list(v)}" for k, v in self._placement.items())
        return f"Roles({body})"


def plan_roles(
    workers: Mapping[str, int], *, ps: int, worker: int, scorer: int,
    slots: Mapping[str, int] | None = None,
) -> dict[str, list[str]]:
    """Place roles on workers, spreading load; pure and deterministic.

    Trainers are placed first, one per worker while there are free workers, so compute never
    shares a process when it need not; then servers and the scorer go to the least-loaded workers.
    With fewer workers than roles, roles share processes (the seed's "same host, other port").

    Parameters
    ----------
    workers : mapping of str to int
        Worker address -> number of Dask threads.
    ps, worker, scorer : int
        Number of parameter servers, trainers and scorers.
    slots : mapping of str to int, optional
        Trainers only on these workers, at most this many on each (see
        :meth:`Placement.slots`); servers and the scorer still go anywhere in ``workers``, and
        so, being placed after the trainers, to the least loaded: workers without trainers.

    Examples
    --------
    >>> plan_roles({"a": 1, "b": 1}, ps=1, worker=2, scorer=1)
    {'trainer': ['a', 'b'], 'ps': ['a'], 'scorer': ['b']}
    >>> plan_roles({"a": 1, "gpu": 1}, ps=1, worker=1, scorer=1, slots={"gpu": 1})
    {'trainer': ['gpu'], 'ps': ['a'], 'scorer': ['a']}
    """
    if not workers:
        raise InvalidInput(["the cluster has no workers: start at least one Dask worker."])
    load = {addr: 0.0 for addr in sorted(workers)}
    placed = {addr: 0 for addr in load}
    placement: dict[str, list[str]] = {}
    for kind, count in (("trainer", worker), ("ps", ps), ("scorer", scorer)):
        placement[kind] = []
        for _ in range(count):
            room = list(load) if kind != "trainer" or slots is None else \
                [a for a in load if placed[a] < slots.get(a, 0)]
            if not room:
                raise InvalidInput([f"workers={worker} do not fit: the workers with the job's "
                                    f"resources hold {sum((slots or {}).values())} trainers."])
            # Least loaded first; ties go to the worker with more threads, then to address order.
            addr = min(room, key=lambda a: (load[a] / max(workers[a], 1), -workers[a], a))
            placement[kind].append(addr)
            load[addr] += _WEIGHT[kind]
            placed[addr] += kind == "trainer"
    return placement


@dataclass(frozen=True)
class Placement:
    """Which Dask workers may run a job's trainers (async-ps trainers, sync and ``dt.run``
    ranks): those that declare the Dask worker ``resources`` each trainer needs.

    A worker declares resources when it starts (``dask worker --resources GPU=1``,
    ``Nanny(resources={"GPU": 1})``; dask-cuda's and dask-jobqueue's convention). A trainer's
    task asks for them (:attr:`task_resources`), so it runs only there and holds them while it
    runs: a second job's trainer waits for the worker instead of sharing its GPU. The job's
    other tasks (feeds, saves, pulls) ask for none, so they never wait on the trainer's slot.
    Parameter servers and the scorer ask for none either: they go to the least-loaded workers,
    which are the ones without trainers when there are any.

    Parameters
    ----------
    resources : mapping of str to number, optional
        Resource name -> amount each trainer holds; empty (the default): every worker.

    Examples
    --------
    >>> gpu = Placement.of({"GPU": 1})
    >>> gpu.slots({"tcp://a:1": {}, "tcp://b:2": {"GPU": 2}, "tcp://c:3": {"GPU": 1}})
    {'tcp://b:2': 2, 'tcp://c:3': 1}
    >>> Placement.of(None).slots({"tcp://a:1": {}})
    {'tcp://a:1': 1}
    """

    resources: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, resources: Any, *, name: str = "resources") -> Placement:
        """The placement of ``resources=`` (None or a mapping), checked.

        Raises
        ------
        InvalidInput
            Naming ``name``, the value and the fix (see :func:`resource_problems`).
        """
        problems = resource_problems(resources, name=name)
        if problems:
            raise InvalidInput(problems)
        return cls({str(k): float(v) for k, v in (resources or {}).items()})

    def __bool__(self) -> bool:
        return bool(self.resources)

    @property
    def task_resources(self) -> dict[str, float] | None:
        """What a trainer's task asks of Dask (``client.submit(resources=...)``); None: nothing."""
        return dict(self.resources) or None

    def fits(self, declared: Mapping[str, float]) -> int:
        """How many trainers a worker that declares ``declared`` can hold at once (1 when the
        job needs no resources: one trainer per worker, as placement spreads them)."""
        if not self.resources:
            return 1
        return min(int(math.floor(float(declared.get(r, 0)) / amount + 1e-9))
                   for r, amount in self.resources.items())

    def slots(self, declared: Mapping[str, Mapping[str, float]]) -> dict[str, int]:
        """Worker address -> the trainers it can hold, for the workers of ``declared`` (address
        -> the resources it declares) that can hold one."""
        return {a: n for a, n in ((a, self.fits(r)) for a, r in declared.items()) if n > 0}

    def usable(self, alive: Mapping[str, int],
               declared: Mapping[str, Mapping[str, float]]) -> dict[str, int]:
        """Those of ``alive`` (address -> threads) that can hold a trainer."""
        if not self.resources:
            return dict(alive)
        can = self.slots({a: declared.get(a, {}) for a in alive})
        return {a: n for a, n in alive.items() if a in can}

    def usable_for(self, alive: Mapping[str, int], declared: Mapping[str, Mapping[str, float]],
                   *, need: int, what: str) -> dict[str, int]:
        """:meth:`usable`, refused (:meth:`too_few`) when fewer than ``need`` are.

        Raises
        ------
        InvalidInput
        """
        usable = self.usable(alive, declared)
        if len(usable) < need:
            raise InvalidInput([self.too_few(need=need, what=what, declared={
                a: declared.get(a, {}) for a in alive})])
        return usable

    @property
    def shown(self) -> str:
        """The resources as the user wrote them: ``{'GPU': 1}``."""
        return "{" + ", ".join(f"{r!r}: {v:g}" for r, v in self.resources.items()) + "}"

    def describe(self) -> str:
        """``GPU=1`` (``dask worker --resources``'s spelling)."""
        return ",".join(f"{r}={v:g}" for r, v in self.resources.items())

    def too_few(self, *, need: int, declared: Mapping[str, Mapping[str, float]],
                what: str) -> str:
        """The refusal of a job whose ``what`` (``"workers=4"``) needs ``need`` trainers when
        the workers of ``declared`` hold fewer: names the resource, the workers that have it
        and the fix."""
        slots = self.slots(declared)
        have = sum(slots.values())
        others = sorted({r for d in declared.values() for r in d} - set(self.resources))
        where = ", ".join(f"{a} ({n})" if n > 1 else a for a, n in sorted(slots.items()))
        return (f"resources={self.shown}: {what} needs {need} trainer(s) on workers "
                f"with {self.describe()} and the cluster's {len(declared)} workers have room "
                f"for {have}{f' ({where})' if where else ''}"
                f"{f'; resources declared: {others}' if others and not slots else ''}. Start "
                f"workers with `dask worker --resources {self.describe()}`, lower workers=, or "
                "drop resources=.")


def resource_problems(resources: Any, *, name: str = "resources") -> list[str]:
    """Problems with a ``resources=`` value: None, or a mapping of resource name (str) to an
    amount > 0 (``{"GPU": 1}``); one message each."""
    if resources is None:
        return []
    fix = (f"pass a mapping of Dask worker resource name to the amount each trainer holds, "
           f"{name}={{'GPU': 1}}, as `dask worker --resources GPU=1` declares them")
    if not isinstance(resources, Mapping):
        return [f"{name}={resources!r} is invalid: {fix}."]
    problems = []
    for key, amount in resources.items():
        if not isinstance(key, str) or not key:
            problems.append(f"{name}={dict(resources)!r} is invalid: the resource name "
                            f"{key!r} is not a non-empty str; {fix}.")
        elif isinstance(amount, bool) or not isinstance(amount, numbers.Real) or \
                not math.isfinite(amount) or amount <= 0:
            problems.append(f"{name}={dict(resources)!r} is invalid: {key}={amount!r} is not "
                            f"a finite number > 0 (a job that needs none leaves it out); {fix}.")
    return problems


def check_role_counts(*, ps: object, worker: object, scorer: object, min_ps: int = 1) -> list[str]:
    """Problems with role counts, one message each (empty when all are valid)."""
    problems = []
    for name, value, low in (("ps", ps, min_ps), ("workers", worker, 1), ("scorer", scorer, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            problems.append(f"{name}={value!r} is invalid: use an integer >= {low}.")
    if isinstance(scorer, int) and scorer > 1:
        problems.append(f"scorer={scorer!r} is invalid: use 0 (no scoring) or 1.")
    return problems


def balance_blocks(rows: Sequence[int], holders: Sequence[str], workers: Mapping[str, int]
                   ) -> list[str]:
    """Where each block should live so every worker holds rows in proportion to its threads.

    Blocks stay where they are unless their worker holds more than its share; the fewest rows
    move, each to the worker furthest below its share. Pure and deterministic.

    Dask places a collection's blocks where its tasks happened to run, often unevenly (20 of 22
    blocks on one of two workers for a memory-mapped array, 3 of 4 for a small generated one):
    the trainer of the crowded worker then does most of the work, and the other reads remote
    blocks. Balanced holders let every trainer read its own worker's blocks.

    Parameters
    ----------
    rows : sequence of int
        Rows per block.
    holders : sequence of str
        The worker holding each block now ("" when unknown: such a block goes where it fits).
    workers : mapping of str to int
        Live worker address -> threads.

    Returns
    -------
    list of str
        The target worker of each block.

    Examples
    --------
    >>> balance_blocks([10, 10, 10, 10], ["a", "a", "a", "b"], {"a": 1, "b": 1})
    ['b', 'a', 'a', 'b']
    """
    if not workers:
        return list(holders)
    total = float(sum(rows))
    threads = sum(max(1, t) for t in workers.values())
    share = {w: total * max(1, t) / threads for w, t in workers.items()}
    target = [h if h in workers else "" for h in holders]
    load = {w: 0.0 for w in workers}
    for i, h in enumerate(target):
        if h:
            load[h] += rows[i]
    # Take blocks off a crowded worker while the move brings it closer to its share: the
    # smallest blocks first, which moves the fewest rows per unit of balance.
    for w in sorted(workers):
        mine = sorted((i for i, h in enumerate(target) if h == w), key=lambda i: (rows[i], i))
        for i in mine:
            if load[w] - rows[i] / 2 <= share[w]:
                break
            target[i], load[w] = "", load[w] - rows[i]
    # Place the homeless blocks, largest first, on the worker furthest below its share.
    for i in sorted((i for i, h in enumerate(target) if not h), key=lambda i: (-rows[i], i)):
        w = min(sorted(workers), key=lambda a: (load[a] - share[a]) / max(share[a], 1.0))
        target[i], load[w] = w, load[w] + rows[i]
    return target
