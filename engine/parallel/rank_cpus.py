"""Each CPU rank's share of its node: how many torch threads it runs, and the cores its forward
thread is pinned to (EngineConfig.tensor_parallel_pin_cpus).

Why pin: the ranks of a CPU engine meet at every collective (six in a decode step of the bench
preset), so a rank the scheduler migrates, or puts on its partner's core for a while, makes the
other wait at the next one. Off by default: in one-process traces on a 2-core machine the
pinned ranks' segments between collectives ran level where unpinned ones drifted 10-20% apart,
but over whole benchmark runs on that shared machine pinning did not measurably change the
step or the share spent in collectives (bench/results/tensor_parallel.md, "pinned ranks").

The driver assigns the cores (rank_cores): rank r gets the r-th block of threads_per_rank
cores of the driver's own allowed set, so every rank's share comes from one decision and no
two ranks of one engine share a core. A node with fewer cores than ranks pins nothing. Only
the thread that runs a rank's forward is pinned (os.sched_setaffinity on a thread id), not its
process: a served replica's other threads (Ray's, the KV plane's) keep every core. Threads
that thread starts afterwards inherit the pin (torch's intra-op pool, when it starts one).
Several engines of one node pin their rank r to the same cores: like threads_per_rank, the
assignment assumes one engine per node's cores.
"""

from __future__ import annotations

import os
import threading


def node_cores() -> list[int]:
    """The cores this process may run on: its main thread's set, as it was before a rank
    pinned it (a process whose main thread runs one engine's forward may start another)."""
    main = threading.main_thread().native_id
    with PinnedThreads._lock:
        held = PinnedThreads._held.get(main) if main is not None else None
    return sorted(held[0] if held is not None else os.sched_getaffinity(os.getpid()))


def threads_per_rank(size: int, cores: int | None = None) -> int:
    """CPU ranks share the node's cores instead of each taking all of them."""
    return max((cores or os.cpu_count() or 1) // size, 1)


def rank_cores(rank: int, size: int, cores: list[int]) -> tuple[int, ...] | None:
    """Rank r's own cores out of cores (the driver's allowed set): its block of
    threads_per_rank of them. None when there are fewer cores than ranks: nothing is pinned."""
    if len(cores) < size:
        return None
    per = threads_per_rank(size, len(cores))
    return tuple(cores[rank * per : (rank + 1) * per])


class PinnedThreads:
    """The threads one rank pinned to its cores (pin_calling_thread), each put back on the set it
    had before when the rank ends (release). A thread that two engines of one process pinned
    is put back once the last of them releases it."""

    _lock = threading.Lock()
    # Over the process: thread id -> (its set before the first pin, how many holders pin it).
    _held: dict[int, tuple[set[int], int]] = {}

    def __init__(self, cores: tuple[int, ...] | None):
        self.cores = cores
        self._mine: set[int] = set()

    def pin_calling_thread(self) -> None:
        """Pin the calling thread to this rank's cores (once per thread; nothing without cores)."""
        if self.cores is None:
            return
        tid = threading.get_native_id()
        if tid in self._mine:
            return
        with self._lock:
            before, holders = self._held.get(tid, (None, 0))
            if before is None:
                before = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.cores)
            self._held[tid] = (before, holders + 1)
            self._mine.add(tid)

    def release(self) -> None:
        """Put back the threads this rank pinned (those still alive) once no one else holds them."""
        with self._lock:
            alive = {thread.native_id for thread in threading.enumerate()}
            for tid in self._mine:
                before, holders = self._held.pop(tid)
                if holders > 1:
                    self._held[tid] = (before, holders - 1)
                    continue
                if tid in alive:  # an ended thread's id may be another's by now
                    try:
                        os.sched_setaffinity(tid, before)
                    except OSError:
                        pass  # it ended just now
            self._mine.clear()
