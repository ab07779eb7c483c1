"""The sync ranks' gradient sum through host memory, when every rank of the group is on one host.

Why: on one machine gloo still goes through loopback sockets. For the digits MLP (30 KB of
gradients a step) its all-gather took 0.6-0.85 ms against ~0.3 ms of compute for 64 rows, so the
ranks waited for their collective most of the time. Here each bucket has a slot per rank in a
segment of ``/dev/shm`` (:mod:`dask_train.engines.holders.host_memory`): a rank writes its
gradients into its slot and then its round number into its flag; once every rank's flag shows
the round, each adds the slots in rank order, so all ranks get bitwise the same sum, as gloo's
all-gather path does. Two slots per rank alternate by round: a rank writes round r+2 only after
seeing every flag of round r+1, which its peers raise only after reading round r.

Ordering: the data is stored before the flag and read after it; x86-64 keeps stores in order and
loads in order (TSO), which this relies on, so other architectures keep gloo.

Waiting: a short spin, then yielding the core (``sleep(0)``), then naps of a twentieth of the
wait so far (100 us to 1 ms), so a waiting rank leaves the CPU to its peers on a machine with
fewer cores than processes (naps of 100 us took 12% of a core here, of 1 ms 2%). Every few
milliseconds it checks that its peers' processes live, that no rank aborted the group (a rank
whose own code raised marks it) and that the process group was not destroyed (the controller's
way of releasing ranks), raising ``ConnectionError`` as gloo would. A stopped job is not a
reason: the ranks stop together, after the sum their stop votes travel in.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dask_train.engines.holders import host_memory
from dask_train.engines.holders.host_memory import HostSegment
from dask_train.runtime._processes import pid_alive

logger = logging.getLogger(__name__)

#: Largest segment (bytes) the ranks may use: two slots per rank per gradient element.
MAX_BYTES = 1 << 30


class HostSum:
    """Sums the ranks' buckets through one segment of their host's memory.

    Use :meth:`join` (collective: every rank calls it) to get one, or None where the group keeps
    gloo; then :meth:`start` one work per bucket per step, in bucket order.
    """

    def __init__(self, seg: HostSegment, rank: int, world: int, n_buckets: int,
                 timeout: float, *, in_group: bool = True) -> None:
        self.seg, self.rank, self.world = seg, rank, world
        # Whether the ranks are a torch process group, whose end releases them (the
        # strategy="auto" probe sums without one: see engines.measure.step).
        self.in_group = in_group
        self.flags = seg.array("flags")  # [bucket, parity, rank]
        self.pids = seg.array("pids")
        self.data = [torch.from_numpy(seg.array(f"b{b}")) for b in range(n_buckets)]
        self.timeout = timeout
        self.rounds = [0] * n_buckets

    @classmethod
    def join(cls, spans: Sequence[tuple[int, int]], *, address: str,
             timeout: float) -> HostSum | None:
        """Every rank of the default group calls this once: a HostSum when all ranks share a
        host and could map the segment, else None on every rank."""
        rank, world = dist.get_rank(), dist.get_world_size()
        ok = world > 1 and host_memory.enabled() and platform.machine() in ("x86_64", "AMD64")
        need = 2 * world * sum(end - start for start, end in spans) * 4
        ok = ok and need <= MAX_BYTES
        addresses: list[Any] = [None] * world
        dist.all_gather_object(addresses, (address, ok))
        if not all(good and host_memory.same_host(a, addresses[0][0]) for a, good in addresses):
            return None
        name: list[str | None] = [None]
        seg = None
        if rank == 0:
            path = host_memory.new_path("sum")
            entries = {"flags": ("int64", (len(spans), 2, world)), "pids": ("int64", (world,)),
                       **{f"b{b}": ("float32", (2, world, end - start))
                          for b, (start, end) in enumerate(spans)}}
            try:
                seg = HostSegment.create(path, entries=entries, extra={})
                name = [path]
            except OSError as exc:
                logger.info("sync ranks keep gloo: no room in host memory (%s)", exc)
        dist.broadcast_object_list(name, src=0)
        if rank != 0 and name[0] is not None:
            seg = HostSegment.attach(name[0])
        mapped = torch.tensor([0 if seg is None else 1])
        dist.all_reduce(mapped, op=dist.ReduceOp.MIN)
        if not int(mapped):
            if seg is not None:
                seg.close()
            return None
        assert seg is not None
        group = cls(seg, rank, world, len(spans), timeout)
        group.pids[rank] = os.getpid()
        dist.barrier()  # every pid is written before anyone checks them
        return group

    def start(self, bucket: int, data: torch.Tensor) -> _HostWork:
        """Publish this rank's ``data`` for ``bucket``'s round; ``wait()`` leaves the sum in it."""
        self.rounds[bucket] += 1
        r = self.rounds[bucket]
        parity = r % 2
        self.data[bucket][parity, self.rank].copy_(data)
        self.flags[bucket, parity, self.rank] = r  # after the data: see the module's docstring
        return _HostWork(self, bucket, parity, r, data)

    def abort(self) -> None:
        """Release the peers waiting on this rank: they raise ``ConnectionAbortedError``."""
        self.seg.header[host_memory.ABORTED] = self.rank + 1

    def check(self, waiting_for: Sequence[int]) -> None:
        """Raise ConnectionError where a wait can never end (see the module's docstring)."""
        aborted = int(self.seg.header[host_memory.ABORTED])
        if aborted:
            raise ConnectionAbortedError(
                f"Connection closed by peer: rank {aborted - 1} left the group's host-memory sum")
        for peer in waiting_for:
            pid = int(self.pids[peer])
            if pid and not pid_alive(pid):
                raise ConnectionResetError(
                    f"Connection reset: rank {peer}'s process ({pid}) is gone")
        if self.in_group and not dist.is_initialized():
            raise ConnectionAbortedError("Connection closed by peer: the group was released")

    def close(self) -> None:
        """Unmap; rank 0 removes the file. The views into the segment go first: a mapping
        with views left cannot be closed, and keeps a descriptor open."""
        self.data, self.flags, self.pids = [], self.flags.copy(), self.pids.copy()
        self.seg.close()


class _HostWork:
    """One bucket's sum in flight (as a gloo work object: ``wait()``)."""

    def __init__(self, group: HostSum, bucket: int, parity: int, round_: int,
                 out: torch.Tensor) -> None:
        self.group, self.bucket, self.parity, self.round, self.out = (
            group, bucket, parity, round_, out)

    def wait(self) -> None:
        group = self.group
        flags = group.flags[self.bucket, self.parity]
        spins, started, checked = 0, time.monotonic(), 0.0
        while True:
            if int(flags.min()) >= self.round:
                break
            spins += 1
            if spins < 64:
                continue
            now = time.monotonic()
            if now - checked > 0.005:
                checked = now
                group.check([p for p in range(group.world) if flags[p] < self.round])
                if now - started > group.timeout:
                    raise TimeoutError(
                        f"the ranks' host-memory sum waited {group.timeout:g} s for ranks "
                        f"{[p for p in range(group.world) if flags[p] < self.round]}: a rank "
                        "spends longer than that between two steps; raise timeout= (of dt.run "
                        "or the Trainer)")
            # Naps of a twentieth of the wait so far (100 us to 1 ms): a rank that waits long
            # for a peer (one slower or without a core) leaves it the CPU, at most 5% late.
            time.sleep(0 if spins < 2048 else min(1e-3, max(1e-4, (now - started) / 20)))
        parts = group.data[self.bucket][self.parity]
        torch.add(parts[0], parts[1], out=self.out)
        for part in parts[2:]:
            self.out.add_(part)
