"""Pushes to a small remote shard go over a direct connection (``engines.holders.push_socket``).

Real worker processes (the session's LocalCluster): a shard on one worker, a task on the other
pushing to it through :class:`PSClient`, as a trainer does. The direct path must update exactly
as the local update would, carry the trainer's position and buffers, answer "not here" as the RPC
does, and fail fast, not at the timeout, when the shard's worker goes away.
"""

from __future__ import annotations

import socket
import struct
import uuid
from typing import Any

import dask
import numpy as np
import pytest
import torch
from distributed import Client, Event, get_worker
from distributed.comm.core import CommClosedError

import dask_train.engines.ps.server  # noqa: F401  (registers the push/pull/endpoint handlers)
from dask_train.data._cluster import live_workers
from dask_train.engines.harness.control import drop_job
from dask_train.engines.holders.optim import FlatOptimizer
from dask_train.engines.holders.params import DIRECT_MAX_ELEMENTS, PSClient, ShardRef
from dask_train.engines.holders.push_socket import push_endpoint
from dask_train.engines.ps.server import start_shard_task
from dask_train.policy._settings import OptimizerSettings
from dask_train.runtime._plugin import worker_state
from dask_train.runtime._roles import ensure_plugin

N_IN, N_OUT = 20, 5
N_PARAMS = N_IN * N_OUT + N_OUT


#: The generation's push secret in these tests (an engine draws 32 random bytes).
SECRET = bytes(range(32))


def _start(job: str, shard: ShardRef, n_in: int = N_IN, n_out: int = N_OUT) -> str:
    torch.manual_seed(0)
    address = start_shard_task(torch.nn.Linear(n_in, n_out), job=job, shard=shard,
                               optim=OptimizerSettings("adam", 0.01), max_step=None,
                               secret=SECRET)
    # As for a model with one buffer value (a BatchNorm counter): the pushes carry it.
    worker_state(get_worker()).job(job).params[shard.index].buffers = np.zeros(1)
    return address


def _grads(n: int, count: int) -> list[np.ndarray]:
    gen = np.random.default_rng(0)
    return [gen.normal(size=n).astype(np.float32) for _ in range(count)]


def _push(job: str, shards: list[ShardRef], n: int, count: int, depth: int) -> dict:
    """Task: ``count`` pushes with ``depth`` in flight; the last parameters and how they went."""
    worker = get_worker()
    ps = PSClient(worker, job, worker_state(worker).job(job), shards, timeout=60, secret=SECRET)
    buffers = [torch.empty(n) for _ in range(depth + 1)]
    pending, last = [], None
    for i, g in enumerate(_grads(n, count)):
        buf = buffers[i % len(buffers)]
        buf.copy_(torch.from_numpy(g))
        pending.append(ps.push(buf, 64, [1, 0, 7, 64 * (i + 1)], np.array([float(i)])))
        if len(pending) > depth - 1:
            last = ps.wait(pending.pop(0))
    for p in pending:
        last = ps.wait(p)
    direct = {i: c is not None for i, c in ps._direct.items()}
    ps.close()
    assert last is not None
    params = np.concatenate([p for _, p in sorted(last.params, key=lambda rp: rp[0].start)])
    return {"params": params, "version": last.version, "direct": direct}


def _shard_state(job: str, index: int) -> dict:
    server = worker_state(get_worker()).job(job).params[index]
    return {"positions": server.positions, "buffers": server.buffers, "version": server.version}


def _expected(count: int) -> np.ndarray:
    """The same updates applied in this process."""
    torch.manual_seed(0)
    flat = torch.cat([p.detach().reshape(-1) for p in torch.nn.Linear(N_IN, N_OUT).parameters()])
    opt = FlatOptimizer(flat.numpy(), OptimizerSettings("adam", 0.01, {}))
    for g in _grads(N_PARAMS, count):
        opt.grad.copy_(torch.from_numpy(g))
        opt.step(64)
    return opt.param.detach().numpy()


@pytest.fixture
def job(client: Client):
    ensure_plugin(client)
    name = f"socket-{uuid.uuid4().hex[:8]}"
    yield name
    client.run(drop_job, name)


@pytest.mark.parametrize("depth", [1, 3])
def test_a_remote_push_goes_direct_and_updates_exactly(client: Client, job: str,
                                                       depth: int) -> None:
    server, other = sorted(live_workers(client))
    shard = ShardRef(0, 0, N_PARAMS, server)
    client.submit(_start, job, shard, workers=[server], pure=False).result()
    got = client.submit(_push, job, [shard], N_PARAMS, 12, depth, workers=[other],
                        pure=False).result()
    assert got["direct"] == {0: True}
    assert got["version"] == 12
    np.testing.assert_array_equal(got["params"], _expected(12))
    state = client.submit(_shard_state, job, 0, workers=[server], pure=False).result()
    # The trainer's place in its data, and its buffers, arrived with the pushes.
    assert state["positions"] == {1: {(0, 7): 64 * 12}}
    np.testing.assert_array_equal(state["buffers"], [11.0])


def test_two_shards_one_here_one_there(client: Client, job: str) -> None:
    a, b = sorted(live_workers(client))
    half = N_PARAMS // 2
    shards = [ShardRef(0, 0, half, a), ShardRef(1, half, N_PARAMS, b)]
    for ref in shards:
        client.submit(_start_slice, job, ref, workers=[ref.address], pure=False).result()
    got = client.submit(_push, job, shards, N_PARAMS, 6, 1, workers=[a], pure=False).result()
    assert got["direct"] == {1: True}  # the shard on the pusher's own worker is called in-thread
    np.testing.assert_array_equal(got["params"], _expected(6))


def _start_slice(job: str, shard: ShardRef) -> str:
    return _start(job, shard)


def test_a_large_shard_keeps_dasks_rpc(client: Client, job: str) -> None:
    server, other = sorted(live_workers(client))
    n_in = DIRECT_MAX_ELEMENTS // 8 + 1
    n = n_in * 8 + 8
    shard = ShardRef(0, 0, n, server)
    client.submit(_start, job, shard, n_in, 8, workers=[server], pure=False).result()
    got = client.submit(_push, job, [shard], n, 2, 1, workers=[other], pure=False).result()
    assert got["direct"] == {0: False}
    assert got["version"] == 2


def test_a_shard_that_is_not_there_is_a_key_error(client: Client, job: str) -> None:
    server, other = sorted(live_workers(client))
    shard = ShardRef(0, 0, N_PARAMS, server)  # never started
    pushed = client.submit(_push, job, [shard], N_PARAMS, 1, 1, workers=[other], pure=False)
    with pytest.raises(KeyError, match="not on worker"):
        pushed.result()
    # Its traceback keeps the future alive past this test: let go of its key on the cluster,
    # or a later test of this process finds it among the client's futures.
    pushed.release()


def _push_until_error(job: str, shard: ShardRef) -> str:
    worker = get_worker()
    ps = PSClient(worker, job, worker_state(worker).job(job), [shard], timeout=60,
                  secret=SECRET)
    grad = torch.zeros(N_PARAMS)
    ps.wait(ps.push(grad, 1))
    assert ps._direct[0] is not None
    Event(f"{job}-pushing").set()
    try:
        while True:
            ps.wait(ps.push(grad, 1))
    except CommClosedError as exc:
        return str(exc)


@pytest.mark.timeout(180)
def test_losing_the_shards_worker_fails_the_push_at_once(client: Client, job: str) -> None:
    """Not after the 60 s timeout: the closed connection says it."""
    server, other = sorted(live_workers(client))
    shard = ShardRef(0, 0, N_PARAMS, server)
    client.submit(_start, job, shard, workers=[server], pure=False).result()
    pushing = client.submit(_push_until_error, job, shard, workers=[other], pure=False)
    assert Event(f"{job}-pushing", client=client).wait(60)
    client.restart_workers([server])
    message = pushing.result(timeout=50)
    assert f"parameter-server shard 0 on {server}" in message


def test_only_plain_tcp_workers_open_an_endpoint() -> None:
    """An in-process cluster (inproc://) keeps Dask's RPC, as TLS would; so does a TCP worker
    whose config turns the direct path off."""
    def endpoint(dask_worker: Any) -> str | None:
        return push_endpoint(dask_worker)

    with Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0",
                set_as_default=False) as c:
        assert list(c.run(endpoint).values()) == [None]
    with Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0",
                protocol="tcp", set_as_default=False) as c:
        (address,) = live_workers(c)
        host = address.split("://")[1].rsplit(":", 1)[0]
        with dask.config.set({"dask-train.direct-push": False}):
            assert list(c.run(endpoint).values()) == [None]
        (got,) = c.run(endpoint).values()
        assert got is not None and got.startswith(f"{host}:")


def _raw_push(endpoint: str, job: str, secret: bytes, *, pushes: int, n_grad: int = N_PARAMS,
              value: float = 100.0) -> int:
    """A stranger's client: the wire format read from the source, a secret guessed; the pushes
    it got answers to before the connection closed."""
    host, port = endpoint.rsplit(":", 1)
    answered = 0
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        name = job.encode()
        sock.sendall(struct.pack("<H", len(name)) + name + struct.pack("<i", 0) + secret)
        grad = np.full(max(0, min(n_grad, N_PARAMS)), value, dtype=np.float32)
        try:
            for _ in range(pushes):
                sock.sendall(struct.pack("<qB4qqq", 64, 0, 0, 0, 0, 0, n_grad, 0))
                sock.sendall(grad.tobytes())
                reply = sock.recv(struct.calcsize("<BqBq"))
                if not reply:
                    break
                answered += 1
                sock.recv(1 << 20)
        except OSError:
            pass
    return answered


def _endpoint(dask_worker: Any) -> str | None:
    return push_endpoint(dask_worker)


@pytest.mark.parametrize("case", ["no secret", "wrong secret", "oversized gradient"])
def test_a_stranger_on_the_push_port_changes_nothing(client: Client, job: str, case: str) -> None:
    server, other = sorted(live_workers(client))
    shard = ShardRef(0, 0, N_PARAMS, server)
    client.submit(_start, job, shard, workers=[server], pure=False).result()
    endpoint = client.run(_endpoint, workers=[server])[server]
    secret = {"no secret": bytes(32), "wrong secret": bytes(range(1, 33)),
              "oversized gradient": SECRET}[case]
    n_grad = 1 << 40 if case == "oversized gradient" else N_PARAMS
    assert _raw_push(endpoint, job, secret, pushes=50, n_grad=n_grad) == 0
    state = client.submit(_shard_state, job, 0, workers=[server], pure=False).result()
    assert state["version"] == 0  # not one of the 50 pushes was applied
    # The shard and its worker go on: the job's own trainer pushes as before.
    got = client.submit(_push, job, [shard], N_PARAMS, 3, 1, workers=[other], pure=False).result()
    assert got["direct"] == {0: True} and got["version"] == 3
    np.testing.assert_array_equal(got["params"], _expected(3))
