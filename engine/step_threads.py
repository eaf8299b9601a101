"""StepThreads: how many torch intra-op threads a step's forward runs on, by its size.

Why: on a CPU replica that shares its cores with the ingress, HAProxy, Ray and the client
(a colocated deployment on one node), a small step split over two OpenMP threads waits at each
op's barrier for whichever thread lost its core to them, and the threads spin between ops
while those processes wait for the core. A decode step of a few sequences or a short prompt
chunk is too small to gain from the second thread. Measured on the bench preset, colocated on
2 cores, at concurrency 1 with 200-token prompts (bench/results/vs_vllm_bench.md): ITL p50
2.6 ms on two threads against 1.5 on one, and the 200-token prefill 8.9 ms against 6.3; a
1,000-token prefill still runs about twice as fast on two threads.

So a step that computes fewer than `min_tokens` tokens runs on one thread and a larger one on
all of the engine's (torch's thread count when the engine was built). Greedy output does not
depend on the thread count here: the matmuls split their output rows between threads, never a
dot product. Called on the thread that runs the forward (the loop thread, or async
scheduling's forward thread): torch's OpenMP thread count is that thread's setting.
"""

from __future__ import annotations

import torch


class StepThreads:
    def __init__(self, min_tokens: int, max_threads: int | None = None):
        """min_tokens: the fewest tokens a step computes on every thread; 0: every step does."""
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        self.min_tokens = min_tokens
        self.max_threads = max_threads or torch.get_num_threads()
        self._current: int | None = None  # what this object last set (None: not yet)

    def threads_for(self, num_tokens: int) -> int:
        return self.max_threads if num_tokens >= self.min_tokens else 1

    def enter(self, num_tokens: int) -> None:
        """Set the calling thread's torch threads for a step computing num_tokens tokens."""
        if self.min_tokens == 0 or self.max_threads == 1:
            return
        threads = self.threads_for(num_tokens)
        if threads != self._current or torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
            self._current = threads
