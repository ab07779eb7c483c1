"""A direct TCP path for gradient pushes to a remote parameter-server shard.

Why not Dask's RPC: a push of a 30 KB gradient and its 30 KB reply took 2.2-3.2 ms through
``worker.rpc`` on an idle 2-core machine (the trainer's thread hops to its event loop, msgpack
and Dask's framing on both sides, the server's event loop, and back), against 0.4 ms for the
update itself. At 64 rows per trainer the remote trainer waited for its server three quarters of
its time. Here a push is one ``sendall`` from the trainer's own thread and one blocking read of
the reply; the server answers on a thread of its own, outside the worker's event loop.

The socket server is the framework's own network started inside the Dask worker, on a free port
of the worker's own host, as torch.distributed is: one per worker process, started on the first
request for it (``dask_train_endpoint``), one thread per connection. A connection serves one
(job, shard) pair; a trainer opens one per remote shard. Only for ``tcp://`` workers: a cluster
on TLS or another transport keeps Dask's RPC, with its security, as does a worker whose Dask
config sets ``dask-train.direct-push: false``. Pulls (rare: start, scorer) stay on Dask's RPC.

Who may push: the port is outside Dask's own security, and a job id can be read from the
scheduler's public ``/metrics``. So a connection's hello carries the generation's push secret
(32 random bytes the engine makes and sends to its servers and trainers through Dask, never
derived from the job id), checked in constant time against the shard's before any push is
applied; and every size a peer announces is checked against the shard's before anything is
allocated. A peer failing either is logged once and disconnected; the shard and the worker go on.

Wire format (little-endian), after a hello of ``<H`` job length, the job id, ``<i`` shard, the
32-byte secret:
request ``<q samples, B has_position, 4q position, q n_grad (float32), q n_buffers (float64)>``
then the values; reply ``<B status, q version, B stop, q n_params (float32)>`` then the values,
or for status 1 (the shard is not here) ``q`` a message length and the message.
"""

from __future__ import annotations

import hmac
import logging
import socket
import struct
import threading
from typing import Any

import numpy as np
from distributed import Worker

from dask_train.engines.holders.reach import holder_or_reason
from dask_train.runtime._denormals import call_flushed
from dask_train.runtime._hosts import split_endpoint, worker_host

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("<H")
_SHARD = struct.Struct("<i")
_REQUEST = struct.Struct("<qB4qqq")
_REPLY = struct.Struct("<BqBq")
_MISSING_LEN = struct.Struct("<q")
#: Bytes of a generation's push secret (``secrets.token_bytes``).
SECRET_BYTES = 32
#: Bytes read at a time when a push to a shard that is not here is skipped.
_DISCARD = 1 << 20

_servers: dict[str, PushServer] = {}
_servers_lock = threading.Lock()


def _raw(array: np.ndarray) -> memoryview:
    """The bytes of a contiguous array, to send from or receive into without a copy."""
    return array.data.cast("B")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionResetError("the peer closed the connection")
        view = view[n:]


def _recv_bytes(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf))
    return buf


class PushServer:
    """The worker's socket server for pushes: a listening socket and a thread per connection.

    Parameters
    ----------
    worker : distributed.Worker
    host : str
        The worker's own host (from its address): peers reach it there.
    """

    def __init__(self, worker: Worker, host: str) -> None:
        self.worker = worker
        self.listener = socket.create_server((host, 0))
        self.endpoint = f"{host}:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True,
                         name="dask-train-push-server").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # the listener is closed: the worker is going away
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="dask-train-push-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        peer = "?"
        try:
            with conn:
                host, port = conn.getpeername()[:2]
                peer = f"{host}:{port}"
                (size,) = _HELLO.unpack(_recv_bytes(conn, _HELLO.size))
                job = bytes(_recv_bytes(conn, size)).decode()
                (shard,) = _SHARD.unpack(_recv_bytes(conn, _SHARD.size))
                secret = bytes(_recv_bytes(conn, SECRET_BYTES))
                header = bytearray(_REQUEST.size)
                grad = np.empty(0, dtype=np.float32)
                while True:
                    _recv_exact(conn, memoryview(header))
                    samples, has_pos, p0, p1, p2, p3, n_grad, n_buf = _REQUEST.unpack(header)
                    server = holder_or_reason(self.worker, job, shard)
                    if isinstance(server, str):  # the job ended here: skip the push, say why
                        _discard(conn, 4 * max(0, n_grad) + 8 * max(0, n_buf))
                        text = server.encode()
                        conn.sendall(_REPLY.pack(1, 0, 0, 0) + _MISSING_LEN.pack(len(text)) + text)
                        continue
                    refused = _refusal(server, secret, n_grad, n_buf)
                    if refused:
                        logger.warning("push connection from %s to shard %d of job %s closed: %s",
                                       peer, shard, job, refused)
                        return
                    if grad.size != n_grad:
                        grad = np.empty(n_grad, dtype=np.float32)
                    _recv_exact(conn, _raw(grad))
                    buffers = None
                    if n_buf:
                        buffers = np.empty(n_buf, dtype=np.float64)
                        _recv_exact(conn, _raw(buffers))
                    position = [p0, p1, p2, p3] if has_pos else None
                    # Denormals flushed for the update (runtime._denormals).
                    params, version, stop = call_flushed(server.apply, grad, samples, position,
                                                         buffers)
                    params = np.ascontiguousarray(params, dtype=np.float32)
                    conn.sendall(_REPLY.pack(0, version, bool(stop), params.size))
                    conn.sendall(_raw(params))
        except (OSError, struct.error, UnicodeDecodeError):
            return  # the trainer went away (its job ended, or its worker died), or not a trainer
        except Exception:  # a bug: say so, the trainer sees the connection close
            logger.exception("push connection failed on %s", self.worker.address)

    def close(self) -> None:
        """Stop accepting connections (those open end with their trainers)."""
        self.listener.close()


def _refusal(server: Any, secret: bytes, n_grad: int, n_buf: int) -> str:
    """Why a push to ``server`` is refused before anything is allocated ("" when it is not)."""
    expected = getattr(server, "push_secret", b"")
    if not expected or not hmac.compare_digest(secret, expected):
        return "it did not present the job's push secret"
    size = int(server.param.numel())
    if n_grad != size:
        return f"it announced a gradient of {n_grad} values for a shard of {size}"
    held = server.buffers
    allowed = {0} if held is None else {0, int(held.size)}
    if n_buf not in allowed:
        return f"it announced {n_buf} buffer values where the model has {max(allowed)}"
    return ""


def _discard(conn: socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes in fixed pieces (nothing of the announced size is allocated)."""
    buf = bytearray(min(n, _DISCARD))
    while n > 0:
        view = memoryview(buf)[: min(n, len(buf))]
        _recv_exact(conn, view)
        n -= len(view)


def push_endpoint(worker: Worker) -> str | None:
    """This worker's push endpoint ``host:port``, starting its server on first use; None where
    pushes must keep Dask's RPC: a worker not on plain TCP, or the Dask config
    ``dask-train.direct-push`` set to False (a network that allows only Dask's ports)."""
    import dask

    if not worker.address.startswith("tcp://") or not dask.config.get("dask-train.direct-push", True):
        return None
    host = worker_host(worker.address)
    with _servers_lock:
        server = _servers.get(worker.address)
        if server is None:
            server = _servers[worker.address] = PushServer(worker, host)
    return server.endpoint


class PushConnection:
    """A trainer's connection to one remote shard: send a push now, read its reply later.

    Replies come back in the order the pushes were sent, so several may be in flight.

    Parameters
    ----------
    endpoint : str
        ``host:port`` from :func:`push_endpoint`.
    job : str
    shard : int
    timeout : float
        Seconds any send or reply may take.
    secret : bytes
        The generation's push secret (:data:`SECRET_BYTES` bytes), as its servers hold it.
    """

    def __init__(self, endpoint: str, job: str, shard: int, timeout: float,
                 secret: bytes) -> None:
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a push secret has {SECRET_BYTES} bytes, not {len(secret)}")
        self.sock = socket.create_connection(split_endpoint(endpoint), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        name = job.encode()
        self.sock.sendall(_HELLO.pack(len(name)) + name + _SHARD.pack(shard) + secret)
        self.header = bytearray(_REPLY.size)

    def send(self, grad: np.ndarray, samples: int, position: list[int] | None,
             buffers: np.ndarray | None) -> None:
        """Send one push (``grad`` float32, ``buffers`` float64 or None)."""
        pos = position if position is not None else [0, 0, 0, 0]
        n_buf = 0 if buffers is None else int(buffers.size)
        self.sock.sendall(_REQUEST.pack(int(samples), position is not None, *map(int, pos),
                                        int(grad.size), n_buf))
        self.sock.sendall(_raw(np.ascontiguousarray(grad, dtype=np.float32)))
        if buffers is not None:
            self.sock.sendall(_raw(np.ascontiguousarray(buffers, dtype=np.float64)))

    def receive(self) -> tuple[np.ndarray, int, bool]:
        """The reply to the oldest push in flight: (parameters, version, stop)."""
        _recv_exact(self.sock, memoryview(self.header))
        status, version, stop, n = _REPLY.unpack(self.header)
        if status == 1:
            (size,) = _MISSING_LEN.unpack(_recv_bytes(self.sock, _MISSING_LEN.size))
            raise KeyError(bytes(_recv_bytes(self.sock, size)).decode())
        params = np.empty(n, dtype=np.float32)
        _recv_exact(self.sock, _raw(params))
        return params, int(version), bool(stop)

    def close(self) -> None:
        """Close the connection (the server's thread for it ends)."""
        try:
            self.sock.close()
        except OSError:
            pass


def connection_error(exc: OSError, shard: int, address: str) -> Exception:
    """The error a trainer raises when its push connection fails, as the RPC path would."""
    from distributed.comm.core import CommClosedError

    if isinstance(exc, TimeoutError):
        return TimeoutError(f"parameter-server shard {shard} on {address} did not answer a push "
                            f"in time ({exc})")
    return CommClosedError(f"parameter-server shard {shard} on {address}: {exc}")


def make_endpoint_handler(worker: Worker) -> Any:
    """The ``dask_train_endpoint`` handler: where to send pushes directly (``_ps_socket``), or
    None where they keep Dask's RPC."""

    async def dask_train_endpoint() -> str | None:
        return push_endpoint(worker)

    return dask_train_endpoint
