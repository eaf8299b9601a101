"""ShmCollectives: the collectives of a CPU tensor-parallel group over one shared-memory segment
instead of gloo over loopback (vLLM's CPU backend does the same). The ranks of one CPU replica
are processes of one node, so a collective is a copy into shared memory, a counter published,
the peers' counters awaited and a copy (or a sum) out: tens of microseconds where gloo's
loopback round trips took about 1.3 ms per all-reduce (bench/results/tensor_parallel.md).

The segment: a file in /dev/shm that rank 0 creates, whose path the others read from the group's
TCPStore. Once every rank has mapped it (agreed over gloo) rank 0 unlinks it, so nothing is left
in /dev/shm however the ranks end, a SIGKILL included (the file itself: shm_segment.py). Its layout:

    one 64-byte line per rank: ready, done (op sequence numbers), pid, pid namespace, start time,
        and three fields of the step mailbox (step_mailbox.py: MAILBOX_FIELDS)
    then per rank two slots of slot_bytes each (double-buffered: op n uses slot n % 2)
    then the step mailbox's two buffers of MAILBOX_BYTES each (the driver's forwards)

Every rank counts the group's collectives alike (they are called in the same order on every
rank). In op n a rank that contributes data first waits until every peer is done with op n - 2
(the last op that used the same slot), copies its tensor into its slot and publishes ready = n;
a rank that reads waits for the writers' ready >= n, reads, and every rank then publishes
done = n. So no rank overwrites a slot a peer still reads. The all-reduce sums the slots in
rank order on every rank: every rank gets bitwise the same result.

Memory ordering: x86-64 is TSO -- a store is never reordered with an earlier store, nor a load
with an earlier load -- so a peer that sees a counter also sees the slot data written before it.
The slot copies are torch's ordinary vector stores (glibc's memcpy, where it streams with
non-temporal stores, fences them with sfence before it returns) and each counter is one
aligned 8-byte store (a memoryview of int64). Other architectures would need explicit fences:
there the group stays on gloo (shm_supported).

Waiting: a short spin, then sched_yield, then sleeps growing to 1 ms (two cores are shared
with everything else: a pure spin would starve the very peer it waits for). Every wait is
bounded by the group's timeout, and while sleeping it checks the awaited peers' processes: a
dead one fails the collective at once with TensorParallelError naming it.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from splitserve.engine.parallel.shm_segment import SEGMENT_DIR, map_segment, new_segment_path, unlink_segment
from splitserve.engine.parallel.tp_group import TensorParallelError

logger = logging.getLogger(__name__)

# Per rank and buffer. A tensor larger than this (a long prefill's hidden states, a large
# vocabulary's logits at a big batch) goes over gloo instead: every rank has the same shape for
# a collective, so every rank makes the same choice. Two buffers per rank: 16 MiB for TP 2.
SLOT_BYTES = 4 << 20
SEGMENT_KEY = "splitserve/tp_shm_segment"  # in the group's TCPStore: the segment's path ("": none)
_LINE = 64  # one cache line of counters per rank: ranks never write the same line
_FIELDS = LINE_FIELDS = _LINE // 8
_READY, _DONE, _PID, _PIDNS, _START = range(5)
MAILBOX_FIELDS = (5, 6, 7)  # the line's fields left to the step mailbox (step_mailbox.py)
MAILBOX_BYTES = 256 << 10  # per buffer, two of them: a forward's batch up to ~10k tokens
_DATA_ALIGN = 4096
_MAX_VIEWS = 512
_SPIN_S = 20e-6
_YIELD_S = 2e-3
_FIRST_SLEEP_S = 50e-6
_MAX_SLEEP_S = 1e-3
_LIVENESS_PERIOD_S = 0.05


def shm_supported() -> bool:
    """Linux on x86-64 (TSO: see the module's note on memory ordering), with a /dev/shm."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir(SEGMENT_DIR)


class ShmCollectives:
    def __init__(self, segment: mmap.mmap, rank: int, size: int, timeout_s: float, slot_bytes: int):
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self.slot_bytes = slot_bytes
        self._segment = segment
        self._counters = memoryview(segment)[: size * _LINE].cast("q")
        self._bytes = torch.frombuffer(segment, dtype=torch.uint8)
        self._data_offset = _data_offset(size)
        self._views: dict[tuple, torch.Tensor] = {}
        self._peers = [r for r in range(size) if r != rank]
        self._seq = 0
        self._pidns = _pid_namespace()
        own = rank * _FIELDS
        self._counters[own + _PID] = os.getpid()
        self._counters[own + _PIDNS] = self._pidns
        self._counters[own + _START] = _start_time(os.getpid()) or 0

    @classmethod
    def open(
        cls,
        rank: int,
        size: int,
        store: dist.Store,
        agree: Callable[[bool], bool],
        timeout_s: float,
        slot_bytes: int = SLOT_BYTES,
    ) -> ShmCollectives | None:
        """Rank 0 creates the segment and names it in store; the others map it. agree(ok) is
        True when every rank's ok was (a gloo all-reduce): if any rank could not map it, all
        stay on gloo (None). Rank 0 unlinks the file once agree returns, or raises."""
        path, segment, shm = None, None, None
        nbytes = segment_bytes(size, slot_bytes)
        try:
            if rank == 0:
                path = new_segment_path()
                try:
                    segment = map_segment(path, nbytes, create=True)
                except OSError as exc:  # no /dev/shm room (a container's 64 MiB): gloo it is
                    logger.warning("tensor-parallel collectives stay on gloo: %s: %s", path, exc)
                store.set(SEGMENT_KEY, path if segment is not None else "")
            else:
                named = store.get(SEGMENT_KEY).decode()
                if named:
                    try:
                        segment = map_segment(named, nbytes, create=False)
                    except OSError as exc:  # another /dev/shm (a container of its own)
                        logger.warning("tensor-parallel rank %d stays on gloo: %s: %s", rank, named, exc)
            if segment is not None:
                shm = cls(segment, rank, size, timeout_s, slot_bytes)  # writes this rank's identity
            agreed = agree(shm is not None)
        except BaseException:
            if shm is not None:
                shm.close()
            elif segment is not None:
                segment.close()
            raise
        finally:
            if path is not None:
                unlink_segment(path)
        if not agreed and shm is not None:
            shm.close()
        return shm if agreed else None

    @property
    def collectives(self) -> int:
        """How many collectives this rank has run over the segment."""
        return self._seq

    @property
    def counters(self) -> memoryview:
        """The ranks' lines as int64 (rank r's field f at r * LINE_FIELDS + f)."""
        return self._counters

    def mailbox(self, buf: int) -> torch.Tensor:
        """The step mailbox's buffer buf (0 or 1), as bytes."""
        start = self._data_offset + 2 * self.size * self.slot_bytes + buf * MAILBOX_BYTES
        return self._bytes[start : start + MAILBOX_BYTES]

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.nbytes <= self.slot_bytes

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum in place; the slots added in rank order, so every rank's result is bitwise equal."""
        seq, buf = self._next()
        self.wait_for(_DONE, self._peers, seq - 2, "all-reduce")
        self._slot(self.rank, buf, tensor).copy_(tensor)
        self._publish(_READY, seq)
        self.wait_for(_READY, self._peers, seq, "all-reduce")
        slots = [self._slot(r, buf, tensor) for r in range(self.size)]
        torch.add(slots[0], slots[1], out=tensor)
        for slot in slots[2:]:
            tensor.add_(slot)
        self._publish(_DONE, seq)
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor into every rank's, in place."""
        seq, buf = self._next()
        if self.rank == 0:
            self.wait_for(_DONE, self._peers, seq - 2, "broadcast")
            self._slot(0, buf, tensor).copy_(tensor)
            self._publish(_READY, seq)
        else:
            self.wait_for(_READY, [0], seq, "broadcast")
            tensor.copy_(self._slot(0, buf, tensor))
        self._publish(_DONE, seq)
        return tensor

    def gather_to_driver(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's tensor, in rank order, on rank 0 (copies); None elsewhere."""
        seq, buf = self._next()
        outputs = None
        if self.rank == 0:
            self.wait_for(_READY, self._peers, seq, "gather")
            outputs = [tensor.clone()] + [self._slot(r, buf, tensor).clone() for r in self._peers]
        else:
            self.wait_for(_DONE, self._peers, seq - 2, "gather")
            self._slot(self.rank, buf, tensor).copy_(tensor)
            self._publish(_READY, seq)
        self._publish(_DONE, seq)
        return outputs

    def close(self) -> None:
        """Unmap the segment (the file was unlinked at open)."""
        if self._segment.closed:
            return
        self._views.clear()
        self._bytes = torch.empty(0, dtype=torch.uint8)  # drop the tensors' hold on the mapping
        self._counters.release()
        try:
            self._segment.close()
        except BufferError:
            pass  # a view still held somewhere: the mapping goes with the process

    def _next(self) -> tuple[int, int]:
        self._seq += 1
        return self._seq, self._seq & 1

    def _slot(self, rank: int, buf: int, like: torch.Tensor) -> torch.Tensor:
        # Making a view costs ~5 us, a few times a collective's own copy and sum: steps repeat
        # their shapes, so the views are kept (a bounded number of them).
        key = (rank, buf, like.dtype, like.shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            start = self._data_offset + (2 * rank + buf) * self.slot_bytes
            view = self._views[key] = self._bytes[start : start + like.nbytes].view(like.dtype).view(like.shape)
        return view

    def _publish(self, field: int, seq: int) -> None:
        self._counters[self.rank * _FIELDS + field] = seq

    def wait_for(self, field: int, ranks: list[int], target: int, what: str) -> None:
        """Until every rank in ranks has published field >= target (bounded by the timeout)."""
        counters = self._counters
        waiting = [r for r in ranks if counters[r * _FIELDS + field] < target]
        if not waiting:
            return
        started = time.monotonic()
        deadline, next_check, pause = started + self.timeout_s, started + _LIVENESS_PERIOD_S, _FIRST_SLEEP_S
        while True:
            waiting = [r for r in waiting if counters[r * _FIELDS + field] < target]
            if not waiting:
                return
            now = time.monotonic()
            if now - started < _SPIN_S:
                continue
            if now - started < _YIELD_S:
                os.sched_yield()
                continue
            if now >= deadline:
                reached = f"collective #{self._seq}" if field in (_READY, _DONE) else f"{what} #{target}"
                raise TensorParallelError(
                    f"tensor-parallel {what} on rank {self.rank} failed: rank {waiting[0]} did not reach "
                    f"{reached} within {self.timeout_s:g}s"
                )
            if now >= next_check:
                next_check = now + _LIVENESS_PERIOD_S
                for peer in waiting:
                    if self._exited(peer):
                        pid = counters[peer * _FIELDS + _PID]
                        raise TensorParallelError(
                            f"tensor-parallel {what} on rank {self.rank} failed: rank {peer} (pid {pid}) exited"
                        )
            time.sleep(pause)
            pause = min(pause * 2, _MAX_SLEEP_S)

    def _exited(self, peer: int) -> bool:
        """True when peer's process is gone (or a zombie); False when it cannot be told: a peer
        in another pid namespace is bounded by the timeout alone."""
        line = peer * _FIELDS
        if self._counters[line + _PIDNS] != self._pidns:
            return False
        start = _start_time(self._counters[line + _PID])
        return start is None or start != self._counters[line + _START]


def segment_bytes(size: int, slot_bytes: int) -> int:
    """The segment's size: the counters' lines, every rank's two slots, the mailbox's buffers."""
    return _data_offset(size) + 2 * size * slot_bytes + 2 * MAILBOX_BYTES


def _data_offset(size: int) -> int:
    return -(-size * _LINE // _DATA_ALIGN) * _DATA_ALIGN


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])
