"""persist_data and map_blocks_inplace through the client they are given."""

from __future__ import annotations

import numpy as np
from distributed import Client

from dask_train.data._persist import map_blocks_inplace, persist_data


def _double(pair: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return pair[0] * 2, pair[1]


def test_map_blocks_inplace_waits_through_the_datas_own_client(own_client: Client) -> None:
    # In a process with no default client, where distributed.wait would find none.
    X, y = np.arange(20.0).reshape(10, 2), np.arange(10.0)
    data = persist_data(X, y, client=own_client)
    map_blocks_inplace(data, _double)
    blocks = own_client.gather(data.futures)
    data.release()
    np.testing.assert_array_equal(np.concatenate([b[0] for b in blocks]), X * 2)
    np.testing.assert_array_equal(np.concatenate([b[1] for b in blocks]), y)
