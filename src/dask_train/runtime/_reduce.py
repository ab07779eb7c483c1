"""Tree reduction and parameter broadcast: the plumbing every full-batch job on the workers shares.

Used by the classical models' distributed sums (:mod:`dask_train.classical.full_batch`) and by the
numpy sync engine (:mod:`dask_train.engines.array`): partial results are combined pairwise on the
workers (:func:`tree_reduce`, :func:`add_terms`), and the parameters of an iteration go to the
cluster once (:func:`send_params`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

from distributed import Client, Future

from dask_train.errors import InvalidInput

# -- tree reduction ------------------------------------------------------------------------------


def _combine_group(combine: Callable[[Any, Any], Any], *parts: Any) -> Any:
    # ``combine`` stays a binary function (operator.add, np.add, ...); a fan-in above 2 folds it.
    return functools.reduce(combine, parts)


def tree_reduce(
    futures: Sequence[Future],
    combine: Callable[[Any, Any], Any] = operator.add,
    split_every: int = 2,
    *,
    client: Client | None = None,
) -> Future:
    """Combine the results of ``futures`` on the workers, ``split_every`` at a time, into one future.

    Each level submits one task per group of ``split_every`` neighbouring futures; Dask runs it on
    the worker that already holds most of its inputs, so results are combined where they live and
    nothing is gathered to the client. Put futures that live on the same worker next to each other
    (as :func:`~dask_train.classical.distributed_loss_grad` does) and the first levels move no data at all.

    Parameters
    ----------
    futures : sequence of distributed.Future
        At least one future. A single future is returned as it is.
    combine : callable
        Binary, associative function of two results, e.g. ``operator.add``. With ``split_every > 2``
        it is folded over each group.
    split_every : int
        Fan-in of the tree, >= 2. A larger fan-in means fewer levels (fewer task round trips) but
        more inputs moved to one worker per task.
    client : distributed.Client, optional
        Default: the client of the first future.

    Returns
    -------
    distributed.Future
        The combined result; call ``.result()`` to receive it (one transfer to the client).

    Examples
    --------
    >>> import operator
    >>> import numpy as np
    >>> parts = client.map(lambda i: np.full(3, i), range(5))   # doctest: +SKIP
    >>> tree_reduce(parts, operator.add).result()               # doctest: +SKIP
    array([10, 10, 10])
    """
    problems = []
    if not futures:
        problems.append(
            "futures=[] is invalid: tree_reduce needs at least one future; pass the futures whose "
            "results to combine."
        )
    if isinstance(split_every, bool) or not isinstance(split_every, int) or split_every < 2:
        problems.append(f"split_every={split_every!r} is invalid: use an integer >= 2 (the fan-in).")
    if not callable(combine):
        problems.append(f"combine={combine!r} is invalid: use a binary function such as operator.add.")
    if problems:
        raise InvalidInput(problems)
    level = list(futures)
    if len(level) == 1:
        return level[0]
    client = client or level[0].client
    while len(level) > 1:
        nxt = []
        for start in range(0, len(level), split_every):
            group = level[start : start + split_every]
            if len(group) == 1:  # an odd one out moves up a level unchanged
                nxt.append(group[0])
                continue
            # pure=False: the user's combine need not be deterministic, and equal inputs in two
            # calls must not share a key that one call's release could take from the other.
            nxt.append(client.submit(_combine_group, combine, *group, pure=False))
        # The intermediate futures can be dropped here: the scheduler keeps each result until
        # the tasks that depend on it have run.
        level = nxt
    return level[0]


def add_terms(a: Any, b: Any) -> Any:
    """Add two results of a block function: numbers, arrays, or tuples/lists of them, term by term.

    Examples
    --------
    >>> import numpy as np
    >>> add_terms((1.0, np.ones(2)), (2.0, np.ones(2)))
    (3.0, array([2., 2.]))
    """
    if isinstance(a, (tuple, list)):
        return type(a)(add_terms(x, y) for x, y in zip(a, b))
    return a + b


# -- parameters to the workers ---------------------------------------------------------------------


# Below this many bytes in all task arguments together, parameters travel inside the tasks.
EMBED_PARAMS_BYTES = 2**18


def send_params(client: Client, params: Any, *, copies: int = 1) -> Any:
    """Send the parameters of one iteration to the cluster once; return what the tasks take.

    ``copies`` is the number of tasks that will take them. Small parameters (``copies`` x size up
    to :data:`EMBED_PARAMS_BYTES`) are returned as they are and travel inside the task messages;
    larger ones are scattered once, without ``broadcast``, and the returned future is what the
    tasks take.

    Why, measured on a shared 2-core machine with 2 workers (``benchmarks/classical.py`` part c:
    median ms of one evaluation over 8 small blocks in 2 groups; the client on loopback / behind a
    1 Gbit/s link; ``benchmarks/results/classical.md``):

    ==================  ============  ============  ==============
    parameters          400 B         800 kB        40 MB
    ==================  ============  ============  ==============
    in task arguments   30.4 / 33.8   35.1 / 46.6   139.0 / 730.5
    scatter             35.9 / 34.9   33.7 / 35.6    61.9 / 384.9
    scatter(direct)     37.3 / 36.5   30.9 / 35.4    50.6 / 370.4
    scatter(broadcast)  34.1 / 37.1   34.5 / 42.3    89.0 / 414.4
    scatter+replicate   38.4 / 37.4   41.8 / 43.9    95.9 / 410.9
    ==================  ============  ============  ==============

    * In the task arguments the parameters ride along with the messages that start the tasks:
      no extra round trip, a few ms cheaper for tiny parameters; but every task carries its own
      copy through the scheduler (twice the bytes with 2 groups, 2x slower at 40 MB), and the
      design rule is that tensors never pass through the scheduler: only below 256 KiB in all.
    * ``scatter(direct=True)`` costs a round trip before the tasks can be submitted, then one copy
      goes from the client straight to one worker whatever the number of workers (without
      ``direct`` the scheduler relays it); tasks on other workers fetch it worker-to-worker, and
      a worker that already has it is a source for the next. Fastest from 800 kB up.
    * ``scatter(broadcast=True)`` and ``replicate`` upload or copy it to every worker first, so
      they wait for every copy, and the Active Memory Manager's ReduceReplicas policy drops the
      extra copies within seconds anyway: nothing may depend on replicas surviving, and nothing
      here does.
    """
    nbytes = getattr(params, "nbytes", None)
    if nbytes is not None and nbytes * max(1, copies) <= EMBED_PARAMS_BYTES:
        return params
    # direct=True: from the client straight to a worker; without it the scheduler relays the data.
    return client.scatter(params, hash=False, direct=True)
