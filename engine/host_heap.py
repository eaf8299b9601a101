"""Keep freed activation buffers in the process's heap instead of handing them back to the OS.

Why: a forward allocates its activations afresh each step (a 1,000-token prompt on the bench
model: several MiB per layer). glibc serves blocks that large with mmap, or trims them off the
heap top when freed, so the next step faults the same pages back in, zero-filled by the
kernel: ~4,000 minor faults per 1,000-token prefill where the forward runs on the main
thread's arena (LLMEngine offline, a tensor-parallel follower rank), and its median forward
26-30 ms against 24 ms with the thresholds raised (2 threads, bench model, 32k KV blocks). A
served replica's engine-loop thread has an arena of its own, which faulted 37 pages per such
prefill (0 raised; TTFT within noise, bench/results/vs_vllm_bench.md). vLLM's CPU backend gets
the same by preloading tcmalloc. A replica process calls retain_freed_heap once before its
first forward; the cost is that its resident memory stays at its peak.
SPLITSERVE_HOST_HEAP=default keeps glibc's own thresholds (the benchmark's A/B switch).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

HOST_HEAP_ENV = "SPLITSERVE_HOST_HEAP"
HOST_HEAP_CHOICES = ("retain", "default")
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Served from the heap below this (a prompt's activations; the KV cache, larger, stays mmap'd):
# glibc's ceiling (half its 64 MiB arena heap; a larger value is ignored, though mallopt says 1).
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at the heap top kept up to this before it is returned to the OS. glibc's own is
# twice the largest block freed so far: a forward frees many activations at once, their sum
# exceeds it, and the heap is trimmed after every step.
TRIM_THRESHOLD_BYTES = 256 << 20


def host_heap_mode() -> str:
    value = os.environ.get(HOST_HEAP_ENV, "retain").strip().lower() or "retain"
    if value not in HOST_HEAP_CHOICES:
        raise ValueError(f"{HOST_HEAP_ENV} must be one of {', '.join(HOST_HEAP_CHOICES)}, got {value!r}")
    return value


def retain_freed_heap() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (unless SPLITSERVE_HOST_HEAP=default);
    True where they were set. Another C library (musl, macOS) is left as it is."""
    if host_heap_mode() == "default" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    done = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    done = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and done
    if not done:
        logger.warning("mallopt refused the heap thresholds; freed activations go back to the OS")
    return done
