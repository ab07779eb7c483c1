"""Parameter-server shards in host memory: one file in ``/dev/shm`` per shard, mapped by every
Dask worker process of the host, so trainers there update the shard themselves instead of sending
each gradient over a socket.

Why: on one machine a push still went through the loopback stack (frame, copy, the server's
thread, the reply's copy); at 128 rows of a small MLP a trainer waited for its server about a
third of its time, and the server's updates took a core's share from the trainers. Mapped, an
update is the optimizer's step on the shared tensors, in the trainer's own thread, as PyTorch's
Hogwild example does with ``share_memory_()``; only trainers on other hosts use the network.

What a segment holds (offsets in its layout, a JSON record after the header): a header of
counters (magic, version, samples, the pid of a process in an update, torn updates), the last
blocks each trainer had applied (what ``shard_positions`` reads after a trainer's loss), the
model's buffers (the buffer shard only), the parameters and the optimizer's state tensors.

An update's bookkeeping (the counters, the position it records) is serialized per shard by
``flock`` on the segment's file (each process opens its own descriptor; a thread lock orders
threads of one process). The optimizer's arithmetic of a trainer's own push runs after it, outside
the lock, as Hogwild (and A3C's shared Adam) do: trainers of one host step the same elements at
once, and where two read-modify-writes of one element overlap, one of them is lost for that
element. Measured on the digits MLP (2 trainers, one shard), the lock held across the arithmetic
had each trainer waiting for the other 12% of its time; without it, 4-5% more samples per second.
Pushes that arrive over the network (trainers of other hosts) still step under the lock. Reads for
the next gradient take no lock, so a gradient is computed on parameters at most one update per
other trainer old, possibly with updates part-applied (Hogwild's bound: at most ``trainers - 1``
updates of staleness); a checkpoint or a pull (under the lock) may likewise hold part of an update
whose rows it counts. A process killed inside the bookkeeping releases the lock with the kernel;
the next holder finds its pid in the header, counts a torn update, completes its bookkeeping and
goes on; one killed in its arithmetic has its rows counted already. Every element is a whole float
(aligned 4-byte stores), so a reader never sees a corrupt value, only a mix of the update's before
and after. Before an update starts, its writer puts its intent in the header (the counters before
it, its rows, the position it records); the next holder after a loss inside it sets the counters
and the position from that intent. So a torn update's rows count as applied, once, with whatever
part of its gradient was written: had the count moved and the position not (a kill between the
two), the controller would re-feed rows the count already held, and apply them twice.

Lifetime: the shard's server creates the file (mode 0600, space reserved with
``posix_fallocate`` so a full ``/dev/shm`` is an error at creation, never a SIGBUS later; made
whole under a name that carries its process id, then linked to its own name, which must be free)
and unlinks it when the job drops the shard. A server killed first leaves its file; the next
segment created on the host removes files whose owner (or maker) process is gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from dask_train.runtime._hosts import address_scheme, worker_host
from dask_train.runtime._processes import remove_orphans

logger = logging.getLogger(__name__)

#: Where segments live: a tmpfs on Linux. Elsewhere (no such directory) shards stay in their
#: server's process and every trainer uses the network.
SEGMENT_DIR = "/dev/shm"
PREFIX = "dask-train-"
_MAGIC = 0x64745F73686D3031  # "dt_shm01"
_HEADER_WORDS = 16
# Header words.
MAGIC, LAYOUT_BYTES, VERSION, SAMPLES, WRITER, TORN, OWNER, HAS_BUFFERS, ABORTED = range(9)
#: An update's intent (see ``updating``): version and samples before it, its rows, and the position
#: it records as trainer, epoch, block, rows (trainer -1: none).
INTENT = slice(9, 16)
_LAYOUT_AT = _HEADER_WORDS * 8
_LAYOUT_MAX = 4096 - _LAYOUT_AT
#: Trainers whose recent blocks a segment remembers, and blocks per trainer (as ShardServer).
SLOTS, BLOCKS_KEPT = 256, 8
_SLOT_WORDS = 2 + 3 * BLOCKS_KEPT  # trainer + 1 (0: free), cursor, (epoch, block, rows) x K


def _aligned(offset: int) -> int:
    return (offset + 63) // 64 * 64


def new_path(kind: str) -> str:
    """A fresh segment name for ``kind`` (``/dev/shm/dask-train-<kind>-<random>``)."""
    return os.path.join(SEGMENT_DIR, f"{PREFIX}{kind}-{secrets.token_hex(8)}")


def enabled() -> bool:
    """Whether shards go to host memory here (Dask config ``dask-train.host-memory``, default
    True, and a ``/dev/shm`` to put them in)."""
    import dask

    return bool(dask.config.get("dask-train.host-memory", True)) and os.path.isdir(SEGMENT_DIR)


def same_host(a: str, b: str) -> bool:
    """Whether two Dask addresses are on one host (its address, as Dask sees it: the namespace
    hosts of the multi-host harness differ, although they share a ``/dev/shm``)."""
    scheme = address_scheme(a)
    if scheme == "inproc":
        # Kept as it was: an in-process address has no port, so the old parse compared whole
        # addresses, and only a worker with itself counted as one host.
        return a == b
    return scheme in ("tcp", "tls") and worker_host(a) == worker_host(b)


def owner(path: str) -> int | None:
    """The process id that created the segment at ``path``; None when it is not one (or gone,
    or not ours to read)."""
    try:
        with open(path, "rb") as f:
            head = np.frombuffer(f.read(_HEADER_WORDS * 8), dtype=np.int64)
    except OSError:
        return None
    return int(head[OWNER]) if len(head) == _HEADER_WORDS and head[MAGIC] == _MAGIC else None


#: A segment is made whole under its name, this, and its maker's process id, then linked to its
#: name (see :meth:`HostSegment.create`).
_MAKING = ".making-"


def _maker(name: str) -> int | None:
    """The process id that is making the segment file ``name``; None when it is a whole one."""
    _, sep, pid = name.rpartition(_MAKING)
    return int(pid) if sep and pid.isdigit() else None


def sweep() -> int:
    """Remove segments whose owner process is gone (a server killed before it unlinked its
    file), and those whose maker was killed while it made them; the number removed."""
    return remove_orphans(SEGMENT_DIR, PREFIX, remove=os.unlink,
                          owner=lambda name: _maker(name) or owner(os.path.join(SEGMENT_DIR, name)))


def _forgotten(path: str, fd: int) -> None:
    logger.debug("segment %s was dropped without close()", path)
    with contextlib.suppress(OSError):
        os.close(fd)


#: Mappings of closed segments that views still held open (see HostSegment.close).
_UNMAPPED: list[mmap.mmap] = []
_UNMAPPED_LOCK = threading.Lock()


def release_unmapped(*, collect: bool = False) -> int:
    """Close the mappings of closed segments whose views are gone (each holds a descriptor and,
    its file unlinked, the segment's memory); with ``collect``, after one run of the cycle
    collector when some are still held (views in cyclic garbage: an asyncio future's result, an
    exception's frames). The number still held after it."""
    with _UNMAPPED_LOCK:
        if not _UNMAPPED:
            return 0
        held = [m for m in _UNMAPPED if not _try_close(m)]
        if held and collect:
            import gc

            gc.collect()
            held = [m for m in held if not _try_close(m)]
        _UNMAPPED[:] = held
        return len(held)


def _try_close(m: mmap.mmap) -> bool:
    try:
        m.close()
    except BufferError:
        return False
    return True


#: Longest wait of :meth:`HostSegment.close` for an update of this process to end.
CLOSE_WAIT_S = 5.0


class HostSegment:
    """One shard's file in host memory, mapped in this process.

    Use :meth:`create` (the shard's server) or :meth:`attach` (a trainer or scorer on the same
    host); :attr:`layout` says where each tensor is, :meth:`array` maps one.
    """

    def __init__(self, path: str, fd: int, layout: dict[str, Any], owner: bool) -> None:
        self.path, self.fd, self.layout, self.owner = path, fd, layout, owner
        self.map = mmap.mmap(fd, int(layout["size"]))
        self.header = np.frombuffer(self.map, dtype=np.int64, count=_HEADER_WORDS)
        self.slots = self.array("positions").reshape(SLOTS, _SLOT_WORDS) \
            if "positions" in layout["entries"] else np.zeros((0, _SLOT_WORDS), dtype=np.int64)
        self.thread_lock = threading.Lock()
        self.pid = os.getpid()
        self._slot_of: dict[int, np.ndarray] = {}  # trainer -> its row of ``slots``
        # A segment dropped without close() still gives its descriptor back (a bare descriptor
        # has no finalizer of its own: one lost per fit, per worker, was how it leaked).
        self._finalizer = weakref.finalize(self, _forgotten, path, fd)

    # -- creation and attachment ---------------------------------------------------------------

    @classmethod
    def create(cls, path: str, *, entries: Mapping[str, tuple[str, tuple[int, ...]]],
               extra: Mapping[str, Any]) -> HostSegment:
        """Create the file at ``path`` holding ``entries`` (name -> (dtype, shape)), zeroed.
        ``extra`` is kept in the layout for those who attach."""
        sweep()
        release_unmapped()
        offset = 4096
        laid: dict[str, Any] = {}
        for name, (dtype, shape) in entries.items():
            laid[name] = {"dtype": dtype, "shape": list(shape), "offset": offset}
            size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            offset = _aligned(offset + size)
        layout = {"size": offset, "entries": laid, **dict(extra)}
        text = json.dumps(layout).encode()
        if len(text) > _LAYOUT_MAX:
            raise ValueError(f"segment layout of {len(text)} bytes does not fit its header")
        # Made whole under a name of its own that names this process, then linked to ``path``:
        # a server killed while it made its segment (the fallocate of a large shard takes a
        # while) left a file with no header at ``path``, which no sweep could tell from one
        # still being made, for good (one after a fresh clone's test run).
        making = f"{path}{_MAKING}{os.getpid()}"
        fd = os.open(making, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, offset)  # ENOSPC now, not a SIGBUS on a later write
            header = np.zeros(_HEADER_WORDS, dtype=np.int64)  # a new file reads as zeros
            header[LAYOUT_BYTES], header[OWNER], header[MAGIC] = len(text), os.getpid(), _MAGIC
            os.pwrite(fd, text, _LAYOUT_AT)
            os.pwrite(fd, header.tobytes(), 0)
            os.link(making, path)  # FileExistsError where a segment has the name, as O_EXCL
        except BaseException:
            os.close(fd)
            os.unlink(making)
            raise
        os.unlink(making)
        return cls(path, fd, layout, owner=True)

    @classmethod
    def create_shard(cls, path: str, *, n: int, n_buffers: int | None,
                     state: Mapping[str, tuple[str, tuple[int, ...]]], extra: Mapping[str, Any]
                     ) -> HostSegment:
        """A shard's segment: ``n`` float32 parameters, ``n_buffers`` float64 buffers (None:
        none), ``state`` (name -> (dtype, shape)) optimizer tensors and the trainers' positions."""
        entries = {"positions": ("int64", (SLOTS * _SLOT_WORDS,)),
                   "buffers": ("float64", (max(n_buffers or 0, 0),)),
                   "params": ("float32", (n,)),
                   **{f"state.{k}": v for k, v in state.items()}}
        return cls.create(path, entries=entries, extra=extra)

    @classmethod
    def attach(cls, path: str) -> HostSegment | None:
        """Map the segment at ``path``; None when it is not here (another host's, or a
        container with its own ``/dev/shm``) or not whole."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EACCES):
                logger.debug("cannot open segment %s: %s", path, exc)
            return None
        try:
            head = os.pread(fd, 4096, 0)
            words = np.frombuffer(head[:_LAYOUT_AT], dtype=np.int64)
            if len(words) < _HEADER_WORDS or words[MAGIC] != _MAGIC:
                os.close(fd)
                return None
            layout = json.loads(head[_LAYOUT_AT:_LAYOUT_AT + int(words[LAYOUT_BYTES])])
            return cls(path, fd, layout, owner=False)
        except (OSError, ValueError) as exc:
            os.close(fd)
            logger.debug("cannot map segment %s: %s", path, exc)
            return None

    def array(self, name: str) -> np.ndarray:
        """The entry ``name`` of the layout as an array backed by the segment (no copy)."""
        entry = self.layout["entries"][name]
        dtype, shape = np.dtype(entry["dtype"]), tuple(entry["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self.map, dtype=dtype, count=count,
                             offset=int(entry["offset"])).reshape(shape)

    def state_entries(self) -> dict[str, np.ndarray]:
        """The optimizer's state tensors, by their key in the optimizer's state."""
        return {name[len("state."):]: self.array(name)
                for name in self.layout["entries"] if name.startswith("state.")}

    # -- the update lock --------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the shard for an update or a consistent read: this process's threads, then the
        other processes of the host. A previous holder that died inside an update is counted."""
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def acquire(self) -> None:
        """Take the lock :meth:`locked` holds (a push takes it without a generator's cost)."""
        self.thread_lock.acquire()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self.thread_lock.release()
            raise
        try:
            writer = int(self.header[WRITER])
            if writer:
                self.header[TORN] += 1
                self._complete()
                self.header[WRITER] = 0
                logger.info("process %d was lost inside an update of %s: its rows count as "
                            "applied, with what part of its step was written", writer, self.path)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Let go of the lock :meth:`acquire` took."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            self.thread_lock.release()

    @contextlib.contextmanager
    def updating(self, samples: int, position: Sequence[int] | None = None) -> Iterator[None]:
        """Mark an update of ``samples`` rows in progress (call while :meth:`locked`); inside it
        the caller steps, adds one to the version and ``samples`` to the count, and records
        ``position`` (trainer, epoch, block, rows). A process lost inside it is seen by the next
        holder, who completes those counters and that position."""
        header = self.header
        trainer, epoch, block, rows = (-1, 0, 0, 0) if position is None else \
            (int(p) for p in position[:4])
        header[INTENT] = (header[VERSION], header[SAMPLES], samples, trainer, epoch, block, rows)
        header[WRITER] = self.pid  # last: from here on the intent is whole
        try:
            yield
        finally:
            header[WRITER] = 0

    def _complete(self) -> None:
        # Absolute values, and record() sets a block's rows: completing twice changes nothing.
        version, samples, rows_in, trainer, epoch, block, rows = (int(v) for v in
                                                                   self.header[INTENT])
        self.header[VERSION], self.header[SAMPLES] = version + 1, samples + rows_in
        if trainer >= 0:
            self.record(trainer, epoch, block, rows)

    # -- counters and positions ----------------------------------------------------------------

    def record(self, trainer: int, epoch: int, block: int, rows: int) -> None:
        """Remember that ``trainer`` has applied ``rows`` of (epoch, block) (call while locked).

        Called once per push: the trainer's slot is looked up once per process, and a push of
        the block its previous push was in updates that entry without a search."""
        slot = self._slot_of.get(trainer)
        if slot is None or slot[0] != trainer + 1:
            slot = self._claim(trainer)
            if slot is None:
                return  # more trainers than slots: this one's positions are not kept
            self._slot_of[trainer] = slot
        blocks = slot[2:].reshape(BLOCKS_KEPT, 3)
        previous = blocks[(int(slot[1]) - 1) % BLOCKS_KEPT]
        if previous[0] == epoch and previous[1] == block:
            previous[2] = rows
            return
        same = np.flatnonzero((blocks[:, 0] == epoch) & (blocks[:, 1] == block))
        if len(same):
            blocks[same[0], 2] = rows
            return
        at = int(slot[1])
        blocks[at] = (epoch, block, rows)
        slot[1] = (at + 1) % BLOCKS_KEPT

    def _claim(self, trainer: int) -> np.ndarray | None:
        slots = self.slots
        found = np.flatnonzero(slots[:, 0] == trainer + 1)
        if len(found):
            return slots[found[0]]  # type: ignore[no-any-return]
        free = np.flatnonzero(slots[:, 0] == 0)
        if not len(free):
            return None
        slot = slots[free[0]]
        slot[:] = 0
        slot[2:].reshape(BLOCKS_KEPT, 3)[:, 0] = -1
        slot[0] = trainer + 1
        return slot  # type: ignore[no-any-return]

    def positions(self) -> dict[int, dict[tuple[int, int], int]]:
        """Every trainer's recent blocks, oldest first: trainer -> {(epoch, block): rows}."""
        out: dict[int, dict[tuple[int, int], int]] = {}
        for slot in self.slots[self.slots[:, 0] > 0]:
            blocks = slot[2:].reshape(BLOCKS_KEPT, 3)
            at = int(slot[1])
            order = [*range(at, BLOCKS_KEPT), *range(at)]
            out[int(slot[0]) - 1] = {(int(blocks[i, 0]), int(blocks[i, 1])): int(blocks[i, 2])
                                     for i in order if blocks[i, 0] >= 0}
        return out

    def close(self) -> None:
        """Close the descriptor and the mapping (arrays still in use keep the mapping until
        they are freed), and remove the file if this process created it.

        Never while a thread of this process holds the update lock: the mapping keeps a
        duplicate of the descriptor (``mmap`` dups it), and with it the ``flock``, for as long as
        an array views it, and every other process's next update would wait for it forever (a
        job dropped by Ctrl-C while a trainer here was inside an update left the trainer of the
        other worker waiting). An update holds it for milliseconds; after :data:`CLOSE_WAIT_S` it is
        let go of anyway, and a thread of this process inside an update then fails its release.
        """
        held = self.thread_lock.acquire(timeout=CLOSE_WAIT_S)
        try:
            if self.owner:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            self._finalizer.detach()
            if self.fd >= 0:
                with contextlib.suppress(OSError):
                    fcntl.flock(self.fd, fcntl.LOCK_UN)
                with contextlib.suppress(OSError):
                    os.close(self.fd)
            self.fd = -1
            self._unmap()
        finally:
            if held:
                self.thread_lock.release()

    def _unmap(self) -> None:
        # The mapping holds a duplicate of the descriptor (mmap dups it) and, unlinked, the
        # segment's memory, until the mapping is closed: the segment's own views go first (the
        # header as a copy, for counters read after the close). Views still held elsewhere (a
        # tensor a caller keeps) keep it mapped until the last of them is freed.
        self.header = self.header.copy()
        self.slots = self.slots.copy()
        self._slot_of = {}
        try:
            self.map.close()
        except BufferError:
            # Views of it are still in use (the exchange a trainer's last push returned, held a
            # moment longer, or in garbage the cycle collector has not reached yet): closed by
            # release_unmapped() once they are gone, at the latest when the job is dropped here.
            with _UNMAPPED_LOCK:
                _UNMAPPED.append(self.map)
