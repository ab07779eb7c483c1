"""In-memory data scattered under dask-train's own keys (``dt-sent-...``).

dask-train keeps the source of every block it scatters and sends it again when the worker
holding it is lost (:meth:`~dask_train.data._blocks.BlockSet.resend_lost`). The scheduler does
not know that: it logs "Removing worker ... caused the cluster to lose scattered data, which
can't be recovered" at ERROR for every lost key. Named so, the keys tell
``runtime._quiet_logs``'s log filter that the loss is recovered, and it logs the line at INFO.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from distributed import Client, Future

#: The prefix of the keys of data dask-train sends again when its holder is lost.
RESENT_PREFIX = "dt-sent-"


def _named(values: Sequence[Any]) -> tuple[list[str], dict[str, Any]]:
    keys = [f"{RESENT_PREFIX}{uuid.uuid4().hex}" for _ in values]
    return keys, dict(zip(keys, values))


def scatter_resendable(client: Client, values: Sequence[Any], **kwargs: Any) -> list[Future]:
    """``client.scatter(values, **kwargs)`` under :data:`RESENT_PREFIX` keys, in order (from a
    thread other than the client's event loop)."""
    keys, named = _named(values)
    sent = client.scatter(named, **kwargs)
    return [sent[k] for k in keys]


async def scatter_resendable_async(client: Client, values: Sequence[Any], **kwargs: Any
                                   ) -> list[Future]:
    """:func:`scatter_resendable` on the client's event loop."""
    keys, named = _named(values)
    sent = await client.scatter(named, **kwargs)
    return [sent[k] for k in keys]
