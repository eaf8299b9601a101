"""HostKVCache: the bytes of the host-memory KV tier, and the copies between it and the device
KVCache (the torch side of engine/core/host_block_pool.py; a KVBlockMover).

Layout: host[slot] is one block for every layer, contiguous ([num_slots, 2 * num_layers,
block_numel]), so saving or loading a block is one copy of num_layers * 2 * block_numel
elements instead of 2 * num_layers small ones (vLLM measured the contiguous unit 4-5x faster;
bench/kv_transfer/kv_offload_copy.py measures it here). The device KVCache stays layer-major.

On CUDA the host tensor is pinned and the copies run on a side stream: a save waits for the
work already queued (the evicted block's KV is final), then copies each block device->host
asynchronously; the compute stream waits for it before anything new is queued, so no later
kernel overwrites a block still being read. A load copies each block host->device and
scatters it into the cache on the side stream, and the compute stream waits for it, so the
step's forward reads complete blocks. On CPU both are plain tensor copies.
"""

from __future__ import annotations

import time

import torch

from splitserve.engine.core.kv_cache_tier import KVBlockMover
from splitserve.engine.ops.kv_cache import KVCache

GIB = 1 << 30


def num_host_blocks(kv_cache: KVCache, size_gib: float) -> int:
    """Host blocks that fit in size_gib GiB (0 = no host tier; any positive size holds >= 1)."""
    if size_gib <= 0:
        return 0
    return max(int(size_gib * GIB) // kv_cache.bytes_per_block, 1)


class HostKVCache(KVBlockMover):
    def __init__(self, kv_cache: KVCache, num_slots: int):
        self.kv_cache = kv_cache
        self.num_slots = num_slots
        kv = kv_cache.kv
        self._planes = kv.view(2 * kv_cache.num_layers, kv_cache.num_blocks, -1)  # [2L, N, E]
        self.on_cuda = kv.is_cuda
        self.host = torch.zeros(
            num_slots,
            self._planes.shape[0],
            self._planes.shape[2],
            dtype=kv.dtype,
            pin_memory=self.on_cuda,
        )
        self._stream = torch.cuda.Stream(device=kv.device) if self.on_cuda else None
        # Since start: copy calls and wall seconds spent in them (the caller's critical path).
        self.num_saves = self.num_loads = 0
        self.save_seconds = self.load_seconds = 0.0

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def save(self, device_blocks: list[int], host_slots: list[int]) -> None:
        start = time.perf_counter()
        if self.on_cuda:
            self._save_cuda(torch.tensor(device_blocks, dtype=torch.int64, device=self._planes.device), host_slots)
        else:
            # One copy per block, all layers: faster here than one gather + a transposed
            # index_copy_ (bench/results/kv_offload.md), and no staging tensor.
            for block, slot in zip(device_blocks, host_slots):
                self.host[slot].copy_(self._planes[:, block])
        self.num_saves += 1
        self.save_seconds += time.perf_counter() - start

    def load(self, host_slots: list[int], device_blocks: list[int]) -> None:
        start = time.perf_counter()
        if self.on_cuda:
            self._load_cuda(host_slots, torch.tensor(device_blocks, dtype=torch.int64, device=self._planes.device))
        else:
            for slot, block in zip(host_slots, device_blocks):
                self._planes[:, block].copy_(self.host[slot])
        self.num_loads += 1
        self.load_seconds += time.perf_counter() - start

    # ---- CUDA: pinned memory, side stream --------------------------------------------------
    def _save_cuda(self, ids: torch.Tensor, host_slots: list[int]) -> None:
        compute = torch.cuda.current_stream(self._planes.device)
        side = self._stream
        side.wait_stream(compute)  # the evicted blocks' last writes are done first
        with torch.cuda.stream(side):
            staging = self._planes.index_select(1, ids).transpose(0, 1).contiguous()  # [n, 2L, E]
            for i, slot in enumerate(host_slots):
                self.host[slot].copy_(staging[i], non_blocking=True)  # one DMA per block
            staging.record_stream(side)
        compute.wait_stream(side)  # nothing queued later overwrites a block still being read

    def _load_cuda(self, host_slots: list[int], ids: torch.Tensor) -> None:
        compute = torch.cuda.current_stream(self._planes.device)
        side = self._stream
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            staging = torch.empty(
                len(host_slots), *self.host.shape[1:], dtype=self.host.dtype, device=self._planes.device
            )
            for i, slot in enumerate(host_slots):
                staging[i].copy_(self.host[slot], non_blocking=True)
            self._planes.index_copy_(1, ids, staging.transpose(0, 1))
            staging.record_stream(side)
        compute.wait_stream(side)  # the step's forward reads complete blocks
