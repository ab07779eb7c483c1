"""tree_reduce and distributed_loss_grad on a real 2-worker cluster: sums, placement, bytes to the client."""

from __future__ import annotations

import gc
import operator
import os
import socket
import struct
import time
from typing import Any

import dask.array as da
import numpy as np
import pytest
from distributed import Client, get_worker, wait

import dask_train as dt
from dask_train.data import BlockSet, persist_data


def _part(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(size)


def _least_squares(w: np.ndarray, Xb: np.ndarray, yb: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    r = Xb @ w - yb
    return 0.5 * float(r @ r), Xb.T @ r, Xb.T @ Xb


def _wide_grad(w: np.ndarray, Xb: np.ndarray, yb: np.ndarray) -> tuple[float, np.ndarray]:
    # A gradient of len(w) floats from every block, whatever the block's width.
    return float(yb.sum()), w * float(Xb.shape[0])


def tcp_bytes_received() -> int:
    """Bytes this process received on all its open TCP sockets (Linux TCP_INFO.tcpi_bytes_received).

    A measurement at the socket level: it sees every path by which data reaches this process.
    """
    total, seen = 0, set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            if not link.startswith("socket:") or link in seen:
                continue
            seen.add(link)
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                if len(info) >= 136:
                    total += struct.unpack_from("Q", info, 128)[0]
        except OSError:
            pass
        finally:
            sock.close()
    return total


# -- tree_reduce ----------------------------------------------------------------------------------


@pytest.mark.parametrize("split_every", [2, 4])
@pytest.mark.parametrize("n", [2, 3, 7, 8])
def test_tree_reduce_equals_plain_sum(client: Client, n: int, split_every: int) -> None:
    parts = client.map(_part, range(n), size=1000, pure=False)
    total = dt.tree_reduce(parts, operator.add, split_every=split_every).result()
    expected = sum(_part(i, 1000) for i in range(n))
    np.testing.assert_allclose(total, expected, rtol=1e-12)


def test_tree_reduce_keeps_the_order_of_a_non_commutative_combine(client: Client) -> None:
    parts = client.map(lambda i: [i], range(9), pure=False)
    assert dt.tree_reduce(parts, operator.add, split_every=4).result() == list(range(9))
    assert dt.tree_reduce(parts, operator.add, split_every=2).result() == list(range(9))


def test_tree_reduce_of_one_future_returns_it(client: Client) -> None:
    fut = client.submit(_part, 0, 10, pure=False)
    assert dt.tree_reduce([fut]) is fut


def test_tree_reduce_rejects_bad_arguments(client: Client) -> None:
    with pytest.raises(dt.InvalidInput) as empty:
        dt.tree_reduce([])
    fut = client.submit(_part, 0, 10, pure=False)
    with pytest.raises(ValueError) as fan_in:
        dt.tree_reduce([fut, fut], split_every=1)
    assert "futures=[]" in str(empty.value) and "at least one future" in str(empty.value)
    assert "split_every=1" in str(fan_in.value)


def test_tree_reduce_sends_one_result_to_the_client(client: Client) -> None:
    n, size = 8, 250_000  # 2 MB per part
    parts = client.map(_part, range(n), size=size, pure=False)
    wait(parts)
    one = client.submit(_part, 99, size, pure=False)
    wait(one)

    before = tcp_bytes_received()
    one.result()
    single = tcp_bytes_received() - before

    before = tcp_bytes_received()
    dt.tree_reduce(parts).result()
    tree = tcp_bytes_received() - before

    before = tcp_bytes_received()
    sum(client.gather(parts))
    gathered = tcp_bytes_received() - before
    # The in-process scheduler relays results, so "one result" is whatever fetching one costs here.
    assert 0.5 * single < tree < 1.5 * single, (single, tree)
    assert gathered > (n - 0.5) * single, (single, gathered)


# -- distributed_loss_grad -----------------------------------------------------------------------


@pytest.fixture
def regression_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(1003, 6))
    return X, X @ rng.normal(size=6) + rng.normal(size=1003)


def test_distributed_loss_grad_equals_numpy(client: Client, regression_data: Any) -> None:
    X, y = regression_data
    w = np.linspace(-1, 1, 6)
    Xd, yd = da.from_array(X, chunks=(150, 3)), da.from_array(y, chunks=200)  # misaligned on purpose
    loss, grad, hess = dt.distributed_loss_grad(_least_squares, w, Xd, yd, client=client)
    expected = _least_squares(w, X, y)
    assert loss == pytest.approx(expected[0], rel=1e-12)
    np.testing.assert_allclose(grad, expected[1], rtol=1e-10)
    np.testing.assert_allclose(hess, expected[2], rtol=1e-10)


def test_distributed_loss_grad_with_numpy_input_and_fan_in(client: Client, regression_data: Any) -> None:
    X, y = regression_data
    w = np.ones(6)
    data = persist_data(X, y, client=client)
    try:
        for split_every in (2, 3):
            loss, grad = dt.distributed_loss_grad(
                lambda p, Xb, yb: _least_squares(p, Xb, yb)[:2], w, data, split_every=split_every
            )
            assert loss == pytest.approx(_least_squares(w, X, y)[0], rel=1e-12)
            np.testing.assert_allclose(grad, _least_squares(w, X, y)[1], rtol=1e-10)
    finally:
        data.release()


def _counted_block(block: np.ndarray) -> np.ndarray:
    get_worker().log_event("test-full-batch-reads", {"rows": len(block)})
    return block


def _held(client: Client) -> set[str]:
    """Keys held in the memory of any worker."""
    return {str(k) for keys in client.has_what().values() for k in keys}


def test_blocks_are_read_from_the_source_once(client: Client, regression_data: Any) -> None:
    X, y = regression_data
    Xd = da.from_array(X, chunks=(250, 6)).map_blocks(_counted_block, dtype=X.dtype)
    yd = da.from_array(y, chunks=250)
    w = np.zeros(6)
    before = _held(client)
    for _ in range(3):
        dt.distributed_loss_grad(_least_squares, w, Xd, yd, client=client)
    reads = client.get_events("test-full-batch-reads")
    assert sum(event["rows"] for _, event in reads) == len(X)  # each block once, not once per call
    assert len(reads) == Xd.numblocks[0]

    # The cached blocks go when the arrays go: seen on the cluster, the keys its workers hold.
    cached = _held(client) - before
    assert len(cached) >= Xd.numblocks[0]  # the persisted blocks (and maybe a late reply)
    del Xd, yd
    gc.collect()
    deadline = time.monotonic() + 10  # the release reaches the scheduler a moment later
    while _held(client) & cached and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _held(client) & cached


def test_client_receives_one_partial_result_per_call(client: Client) -> None:
    # A gradient of 1.6 MB: large enough that the bytes of one result stand out from control traffic.
    rng = np.random.default_rng(2)
    X, y = rng.normal(size=(4000, 3)), rng.normal(size=4000)
    data = persist_data(da.from_array(X, chunks=500), da.from_array(y, chunks=500), client=client)
    try:
        groups = data.groups()
        assert len(groups) >= 2, f"blocks must sit on both workers for this test: {data.holders}"
        w = np.ones(200_000)
        dt.distributed_loss_grad(_wide_grad, w, data)  # warm the connections

        one = client.submit(lambda: (0.0, np.ones(200_000)), pure=False)
        wait(one)
        before = tcp_bytes_received()
        client.gather(one, direct=True)  # fetched from its worker, as distributed_loss_grad does
        single = tcp_bytes_received() - before

        received = []
        for _ in range(3):
            before = tcp_bytes_received()
            loss, grad = dt.distributed_loss_grad(_wide_grad, w, data)
            received.append(tcp_bytes_received() - before)
        assert loss == pytest.approx(y.sum())
        np.testing.assert_allclose(grad, w * len(X))
        for got in received:  # one result per call, though every group made its own partial sum
            assert 0.5 * single < got < 1.5 * single, (single, received, len(groups))
    finally:
        data.release()


def test_block_set_groups_follow_the_holders() -> None:
    data = BlockSet.placed([], [1] * 5, ["a", "b", "a", "a", "b"], threads={"a": 2, "b": 1})
    assert data.groups() == [[0, 2], [3], [1, 4]]


def test_distributed_loss_grad_rejects_a_non_callable(client: Client) -> None:
    with pytest.raises(dt.InvalidInput, match="fn="):
        dt.distributed_loss_grad("not a function", np.zeros(2), np.zeros((2, 2)), np.zeros(2))


def _shift_target(block: tuple[np.ndarray, np.ndarray], by: float) -> tuple[np.ndarray, np.ndarray]:
    return block[0], block[1] + by


def test_in_memory_blocks_lost_with_their_worker_are_sent_again() -> None:
    """In-memory data is scattered (Dask cannot recompute it): after the worker holding a block
    is SIGKILLed, the next sums are the same, from blocks the client sent again with the
    changes made to them since (a label encoding)."""
    import sys
    from pathlib import Path

    from dask_train.classical.full_batch import evaluate_sum
    from dask_train.data._persist import map_blocks_inplace

    sys.path.insert(0, str(Path(__file__).parents[1] / "chaos"))
    from _faults import kill, killable_cluster

    rng = np.random.default_rng(3)
    X, y = rng.normal(size=(300_000, 8)), rng.normal(size=300_000)  # 19 MB: two blocks
    w = rng.normal(size=8)
    with killable_cluster() as own:
        data = persist_data(X, y, client=own)
        map_blocks_inplace(data, _shift_target, 2.0)
        assert len(data.futures) == 2 and len(set(data.holders)) == 2
        before = evaluate_sum(_least_squares, w, data)
        victim = data.holders[0]
        kill(own, victim)
        after = evaluate_sum(_least_squares, w, data)
        assert data.futures[0].status == "finished"
    expected = _least_squares(w, X, y + 2.0)
    for got, old, want in zip(after, before, expected):
        np.testing.assert_allclose(got, old, rtol=1e-10)
        np.testing.assert_allclose(got, want, rtol=1e-8)
