"""Files kept in the memory of Dask workers: an fsspec filesystem (``dask-train-workers://``) for
the state a job keeps in memory when its workers share no directory.

A job without ``checkpoint=`` keeps copies of its state in memory (async-ps shards every few
seconds, the state a hand-over or a regroup passes on). On one machine that memory is a directory
of ``/dev/shm`` that every worker reaches and no worker's death takes. Across machines there is no
such directory; these files live instead in the memory of several workers (the *holders*, given
as the ``holders`` storage option): each file is written to every holder and read from the first
that has it, so the loss of any holder but the last leaves every file readable. The checkpoint
code is unchanged: it writes and reads these paths as it writes a local disk or S3.

A holder keeps its files on its worker object and answers the ``dask_train_files`` RPC handler,
installed on every worker by dask-train's worker plugin (:mod:`._plugin`). The
calls go from any thread (a role's task, the controller) over Dask's own comms, with the
calling worker's or client's security settings, on fsspec's I/O loop.
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fsspec import AbstractFileSystem

from dask_train.errors import InvalidInput

logger = logging.getLogger(__name__)

PROTOCOL = "dask-train-workers"
_FILES_ATTR = "dask_train_files"  # where a holder's worker object keeps its files

#: Seconds a connection to a holder may take (distributed retries a refused one until then).
CONNECT_S = 5.0

#: Seconds the other holders get once one has answered (a hung one does not hold up a write).
GRACE_S = 5.0

#: Seconds after which a call to a holder that has not answered is logged (a WARNING naming
#: the holder and the call: a write waiting on it holds up the job's copy or hand-over).
SLOW_S = 5.0

#: Holders of this process's calls that failed: looked at before they are called again.
_SUSPECTS: set[str] = set()


def url(name: str) -> str:
    """The URL of a directory ``name`` of this filesystem."""
    return f"{PROTOCOL}://{name.strip('/')}"


def _files(worker: Any) -> dict[str, bytes]:
    files = getattr(worker, _FILES_ATTR, None)
    if files is None:
        files = {}
        setattr(worker, _FILES_ATTR, files)
    return files


def _under(path: str, files: Iterable[str]) -> list[str]:
    return [p for p in files if p == path or p.startswith(path + "/")]


def serve(files: dict[str, bytes], action: str, path: str, data: Any = None, to: str = "") -> Any:
    """One action on a holder's ``files``: ``put``, ``get`` (None when absent), ``list``
    (path -> size of every file at or under ``path``), ``rm`` and ``mv`` (a file, or every file
    under a directory, to ``to``)."""
    if action == "put":
        files[path] = bytes(data)
        return None
    if action == "get":
        return files.get(path)
    if action == "list":
        return {p: len(files[p]) for p in _under(path, files)}
    if action == "rm":
        for p in _under(path, files):
            files.pop(p, None)
        return None
    if action == "mv":
        for p in _under(path, files):
            files[to + p[len(path):]] = files.pop(p)
        return None
    raise ValueError(f"unknown action {action!r}")


def make_handler(worker: Any) -> Any:
    """The worker's ``dask_train_files`` handler: :func:`serve` on its files."""
    from distributed.protocol import to_serialize

    async def dask_train_files(action: str, path: str, data: Any = None, to: str = "") -> Any:
        answer = serve(_files(worker), action, path, data, to)
        return {"answer": to_serialize(answer) if isinstance(answer, bytes) else answer}

    return dask_train_files


def register_protocol() -> None:
    """Let fsspec open ``dask-train-workers://`` URLs in this process. Where dask-train is
    installed (every worker of a job), the package's ``fsspec.specs`` entry point does it."""
    from fsspec.registry import known_implementations, register_implementation

    if PROTOCOL not in known_implementations:
        register_implementation(PROTOCOL, f"{__name__}.WorkerMemoryFileSystem", clobber=True)


def _connection_args() -> dict[str, Any]:
    """The calling worker's or client's connection settings (TLS on a secured cluster)."""
    from distributed import get_worker

    try:
        return dict(get_worker().connection_args)
    except ValueError:
        pass
    from distributed import default_client

    try:
        return dict(default_client().connection_args)
    except ValueError:
        return {}


class WorkerMemoryFileSystem(AbstractFileSystem):
    """Files in the memory of the Dask workers ``holders`` (see the module's docstring).

    Parameters
    ----------
    holders : sequence of str
        The workers' addresses. Each file is written to all of them; a write succeeds when one
        holder at least took it. A holder that is gone is skipped.
    timeout : float
        Seconds a call to one holder may take.
    """

    protocol = PROTOCOL
    root_marker = ""

    def __init__(self, holders: Sequence[str] = (), timeout: float = 30.0, **kwargs: Any) -> None:
        if not holders or isinstance(holders, str):
            raise InvalidInput([f"{PROTOCOL}:// needs storage_options={{'holders': [...]}}: "
                                "the addresses of the Dask workers that keep the files."])
        super().__init__(**kwargs)
        self.holders = tuple(holders)
        self.timeout = float(timeout)

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = str(path)
        if text.startswith(PROTOCOL + "://"):
            text = text[len(PROTOCOL) + 3:]
        return text.rstrip("/")

    # -- calls to the holders -----------------------------------------------------------------
    def _ask(self, holders: Sequence[str] | None = None, **message: Any) -> list[Any]:
        """``message`` to every holder (of ``holders``, by default all) at once; each one's
        answer, or the exception it raised."""
        from distributed import Worker
        from fsspec.asyn import get_loop, sync

        holders = self.holders if holders is None else tuple(holders)
        # The files of a holder in this process directly: a call from its event loop (a
        # hand-over's direct write; the controller beside an in-process cluster, whose workers
        # share the client's loop) would wait on that blocked loop.
        here = {w.address: w for w in list(Worker._instances) if w.address in holders}
        others = [a for a in holders if a not in here]
        answers: dict[str, Any] = {}
        for address, worker in here.items():
            try:
                answers[address] = serve(_files(worker), **message)
            except Exception as exc:  # noqa: BLE001 - reported as the holder's answer
                answers[address] = exc
        if others:
            args = _connection_args()
            sent = dict(message)
            if "data" in sent:
                from distributed.protocol import to_serialize

                sent["data"] = to_serialize(sent["data"])

            async def every() -> list[Any]:
                # Every holder's answer, but not a hung one's for long: once one holder has
                # answered, the others get GRACE_S more (a write then stands on the holders
                # that took it, and a read goes to the next holder).
                tasks = [asyncio.ensure_future(self._call(a, sent, args)) for a in others]
                pending = set(tasks)
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    if any(not t.cancelled() and t.exception() is None for t in done):
                        if pending:
                            _, pending = await asyncio.wait(pending, timeout=GRACE_S)
                        break
                late = [others[i] for i, t in enumerate(tasks) if t in pending]
                for task in pending:
                    task.cancel()
                _SUSPECTS.update(late)
                return [OSError(f"{a} did not answer within {GRACE_S:g} s of the others")
                        if t in pending else t.exception() or t.result()
                        for a, t in zip(others, tasks)]

            answers.update(zip(others, sync(get_loop(), every)))
        return [answers[a] for a in holders]

    async def _call(self, address: str, sent: Mapping[str, Any], args: dict[str, Any]) -> Any:
        """``sent`` (a message, its data ready for Dask's comms) to the holder at ``address``,
        on fsspec's loop; its answer."""
        from distributed.core import rpc

        from dask_train.runtime._calls import listens

        # distributed retries a refused connection until its timeout. A holder that failed
        # once is looked at first (a killed one's port refuses at once, a dead host's takes
        # 2 s); not every holder every time: each look is a connection that the worker logs as
        # "closed before handshake completed".
        if address in _SUSPECTS and address.startswith(("tcp://", "tls://")) and \
                not await listens(address):
            raise OSError(f"{address} does not answer")
        slow = asyncio.get_running_loop().call_later(
            SLOW_S, lambda: logger.warning(
                "%s holder %s has not answered a %r of %s within %g s (it gets up to %g s)",
                PROTOCOL, address, sent.get("action"), sent.get("path"), SLOW_S,
                self.timeout + CONNECT_S))
        try:
            async with rpc(address, connection_args=args,
                           timeout=min(self.timeout, CONNECT_S)) as holder:
                reply = await asyncio.wait_for(holder.dask_train_files(**sent), self.timeout)
        except (OSError, asyncio.TimeoutError):
            _SUSPECTS.add(address)
            raise
        finally:
            slow.cancel()
        _SUSPECTS.discard(address)
        # A worker without the handler answers None (Dask logs "No handler").
        if not isinstance(reply, dict) or "answer" not in reply:
            raise OSError(f"{address} keeps no {PROTOCOL} files: dask-train's worker plugin is "
                          "not registered there")
        return reply["answer"]

    def _answers(self, what: str, **message: Any) -> list[Any]:
        """The answers of the holders that answered; OSError when none did."""
        answers = self._ask(**message)
        got = [a for a in answers if not isinstance(a, BaseException)]
        if not got:
            raise self._none_answered(what, answers)
        return got

    def _none_answered(self, what: str, failures: Sequence[Any]) -> OSError:
        """The error of a call no holder answered (the first holder's failure named)."""
        return OSError(f"{what}: none of the workers holding {PROTOCOL} files answered "
                       f"({', '.join(self.holders)}): {failures[0]!r}")

    def _listing(self, path: str) -> dict[str, int]:
        merged: dict[str, int] = {}
        for answer in self._answers(f"listing {path}", action="list", path=path):
            merged.update(answer)
        return merged

    # -- the filesystem -----------------------------------------------------------------------
    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self._answers(f"writing {path}", action="put", path=self._strip_protocol(path),
                      data=bytes(value))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        # One holder after the other: a file is read once, not from every holder.
        failures = []
        for address in self.holders:
            [answer] = self._ask([address], action="get", path=path)
            if isinstance(answer, BaseException):
                failures.append(answer)
            elif answer is not None:
                return bytes(answer)[start:end]
        if len(failures) == len(self.holders):
            raise self._none_answered(f"reading {path}", failures)
        raise FileNotFoundError(path)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "r" in mode:
            return io.BytesIO(self.cat_file(path))
        if "w" in mode:
            return _Upload(self, path)
        raise ValueError(f"{PROTOCOL}:// opens files to read or write whole, not {mode!r}")

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        listing = self._listing(path)
        if path in listing:
            entries = [{"name": path, "size": listing[path], "type": "file"}]
        else:
            children: dict[str, dict[str, Any]] = {}
            prefix = path + "/" if path else ""
            for name, size in listing.items():
                first, _, rest = name[len(prefix):].partition("/")
                child = prefix + first
                children[child] = ({"name": child, "size": 0, "type": "directory"} if rest
                                   else {"name": child, "size": size, "type": "file"})
            if not children and path:
                raise FileNotFoundError(path)
            entries = [children[name] for name in sorted(children)]
        return entries if detail else [e["name"] for e in entries]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        listing = self._listing(path)
        if path in listing:
            return {"name": path, "size": listing[path], "type": "file"}
        if listing or not path:
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        pass  # directories are the files' path prefixes

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        pass

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        for one in [path] if isinstance(path, str) else path:
            self._answers(f"removing {one}", action="rm", path=self._strip_protocol(one))

    def rm_file(self, path: str) -> None:
        self.rm(path)

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth: int | None = None,
           **kwargs: Any) -> None:
        self._answers(f"moving {path1}", action="mv", path=self._strip_protocol(path1),
                      to=self._strip_protocol(path2))

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.pipe_file(path2, self.cat_file(path1))

    def created(self, path: str) -> Any:
        raise NotImplementedError

    def modified(self, path: str) -> Any:
        raise NotImplementedError


class _Upload(io.BytesIO):
    """A file opened to write: sent to the holders, whole, when closed."""

    def __init__(self, fs: WorkerMemoryFileSystem, path: str) -> None:
        super().__init__()
        self.fs, self.path = fs, path

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            super().close()
            self.fs.pipe_file(self.path, data)


def holders_for(alive: Iterable[str], roles: Mapping[str, Any] | Iterable[str] = (),
                keep: Sequence[str] = (), copies: int = 2) -> list[str]:
    """``copies`` workers of ``alive`` to hold a job's files: those of ``keep`` still alive
    first (they hold the files written so far), then workers without a role, then the others,
    in a fixed order."""
    alive = sorted(set(alive))
    busy = set(roles)
    order = ([a for a in keep if a in alive] + [a for a in alive if a not in busy] +
             [a for a in alive if a in busy])
    chosen: list[str] = []
    for address in order:
        if address not in chosen:
            chosen.append(address)
    return chosen[:max(1, copies)]


def remove(path: str, holders: Sequence[str]) -> None:
    """Drop a directory of this filesystem on the holders that still answer."""
    fs = WorkerMemoryFileSystem(holders=holders, skip_instance_cache=True)
    fs._ask(action="rm", path=fs._strip_protocol(path))
